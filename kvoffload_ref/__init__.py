"""kvoffload_ref: a torch-free reference implementation of a KV-cache offloading worker.

GPU KV-cache pages are copied to a pinned host region (store) and back (load) on device streams, with an exact,
bounded and leak-free lifecycle: the worker owns the region, shutdown is bounded by one timeout, memory that may
still be under DMA is quarantined instead of freed, and failed transfers are never reported as successes.
The normative rules are in docs/spec.md.

Only the public API is re-exported here.
"""

from kvoffload_ref.backends import get_backend
from kvoffload_ref.backends.base import Backend, Ledger
from kvoffload_ref.backends.sim import SimBackend, Violation
from kvoffload_ref.errors import (
    BlocksHeldError,
    DeadlineExceeded,
    DeviceError,
    InvalidTransferError,
    LifecycleError,
    OffloadError,
    OwnershipError,
    RegistrationRefused,
    ShutdownDeferred,
    SimHang,
    TransferExpired,
    WorkerClosedError,
)
from kvoffload_ref.faults import Fault, FaultPlan, FaultyBackend
from kvoffload_ref.quarantine import QuarantinedItem, quarantined
from kvoffload_ref.reference import ReferenceWorker, create_reference_worker
from kvoffload_ref.region import HostRegion
from kvoffload_ref.results import (
    HeldBlocks,
    JobOutcome,
    KeptRange,
    PoisonedBlocks,
    ReleasedHold,
    TransferResult,
    poisoned_by_tag,
    poisoned_cpu_chunks,
    poisoned_gpu_blocks,
    poisoned_gpu_blocks_by_group,
)
from kvoffload_ref.shared_region import SharedRegion
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import (
    CPUOffloadingWorker,
    HandlerReport,
    ShutdownPolicy,
    ShutdownReport,
    WorkerStats,
    create_worker,
)

__all__ = [
    "Backend",
    "BlocksHeldError",
    "CPULoadStoreSpec",
    "CPUOffloadingWorker",
    "DeadlineExceeded",
    "DeviceError",
    "Fault",
    "FaultPlan",
    "FaultyBackend",
    "GPULoadStoreSpec",
    "HandlerReport",
    "HeldBlocks",
    "HostRegion",
    "InvalidTransferError",
    "JobOutcome",
    "KVCacheLayout",
    "KeptRange",
    "LayerRef",
    "Ledger",
    "LifecycleError",
    "OffloadError",
    "OwnershipError",
    "PoisonedBlocks",
    "QuarantinedItem",
    "ReferenceWorker",
    "RegistrationRefused",
    "ReleasedHold",
    "SharedRegion",
    "SimBackend",
    "ShutdownDeferred",
    "SimHang",
    "ShutdownPolicy",
    "ShutdownReport",
    "TransferExpired",
    "TransferResult",
    "Violation",
    "WorkerClosedError",
    "WorkerStats",
    "create_reference_worker",
    "create_worker",
    "get_backend",
    "poisoned_by_tag",
    "poisoned_cpu_chunks",
    "poisoned_gpu_blocks",
    "poisoned_gpu_blocks_by_group",
    "quarantined",
]

__version__ = "0.1.0"
