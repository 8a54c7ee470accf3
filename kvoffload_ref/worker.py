"""CPUOffloadingWorker: the fast implementation -- the worker level of ``reference.py`` over the fast handler.

Theory of operation
-------------------
The worker is ``facade.WorkerFacade`` over a ``reference.Core`` (the calls, the lock, the shutdown sequence: R1-R21
are stated there) whose direction handlers are ``handler.DirectionHandler``: pooled streams, events and descriptor
buffers (``prewarm`` transfers' worth created up front), the vectorized planner, batched calls and prefix queries.
The conformance kit, the call-point explorer and the differential test hold it to ``ReferenceWorker``; where they
disagree the reference is right.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload_ref.backends.base import Backend, Stream
from kvoffload_ref.canonical import PageMapping
from kvoffload_ref.canonical_plan import CanonicalLayout, check_canonical
from kvoffload_ref.facade import Pinning, WorkerFacade, build_with_region, check_options
from kvoffload_ref.handler import DirectionHandler
from kvoffload_ref.handler_api import DirectionHandlerAPI
from kvoffload_ref.reference import build_core
from kvoffload_ref.region import DEFAULT_PIN_CHUNK_BYTES, HostRegion
from kvoffload_ref.results import (
    DEFAULT_TIMEOUT,
    HandlerReport,
    ShutdownPolicy,
    ShutdownReport,
    WorkerStats,
)
from kvoffload_ref.running import Running
from kvoffload_ref.specs import Direction, KVCacheLayout, TensorGeometry
from kvoffload_ref.validate import check_int

__all__ = [
    "DEFAULT_TIMEOUT",
    "CPUOffloadingWorker",
    "HandlerReport",
    "ShutdownPolicy",
    "ShutdownReport",
    "WorkerStats",
    "create_worker",
]


class CPUOffloadingWorker(WorkerFacade):
    """Offloads KV-cache pages between GPU tensors and a pinned host region, and shuts down safely.

    The arguments and errors are ``WorkerFacade``'s, and:

    Args:
        prewarm: transfers' worth of events (three each) each handler creates up front (an int >= 0).
        canonical: canonical mode (R24): this rank's mapping of each layout tensor (see ``WorkerFacade``).

    Use :func:`create_worker` unless you built the region yourself.
    """

    def __init__(self, backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                 blocks_per_chunk: int, region: HostRegion, policy: ShutdownPolicy | None = None,
                 pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES, require_pinned: bool = False,
                 prewarm: int = 1, compute_stream: object | None = None,
                 canonical: CanonicalLayout | Sequence[PageMapping] | None = None,
                 stall_warning: float | None = None, pinning: Pinning = "auto") -> None:
        options = check_options(blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, compute_stream, canonical,
                                stall_warning, pinning)
        pooled = check_int("prewarm", prewarm, minimum=0)

        def handlers(backend: Backend, direction: Direction, compute: Stream, layout: KVCacheLayout,
                     gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry], bpc: int,
                     canonical: CanonicalLayout | None, running: Running) -> DirectionHandlerAPI:
            return DirectionHandler(backend, direction, layout, gpu, cpu, bpc, compute_stream=compute,
                                    prewarm=pooled, canonical=canonical, running=running)

        self._attach(build_core(backend, gpu_tensors, layout, region, options, handlers, type(self).__name__))


def create_worker(backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                  blocks_per_chunk: int, num_cpu_chunks: int, policy: ShutdownPolicy | None = None,
                  region: HostRegion | None = None, pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
                  require_pinned: bool = False, prewarm: int = 1, compute_stream: object | None = None,
                  canonical: CanonicalLayout | Sequence[PageMapping] | None = None,
                  stall_warning: float | None = None, pinning: Pinning = "auto") -> CPUOffloadingWorker:
    """Build the region (unless given) and the worker (R1, R2).

    If construction fails, a region built here is released and the original exception propagates; a region
    passed in stays the caller's.

    Args:
        num_cpu_chunks: CPU rows per tensor when building the region (in canonical mode each row is the tensor's
            canonical page times ``blocks_per_chunk``, R24).
        region: an existing caller-owned region to hand over instead of building one.
        pinning: ``"auto"`` (default): the region built here is registered, or, where the platform refuses
            registration, rebuilt as a pinned allocation (a warning, once per backend); ``"register"``;
            ``"alloc"``: built as a pinned allocation. See ``WorkerFacade``.
        The others: as for :class:`CPUOffloadingWorker`.

    Returns:
        The worker, owning its region.

    Raises:
        InvalidTransferError, OwnershipError, DeviceError: as for :class:`CPUOffloadingWorker`.
    """
    options = check_options(blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, None, canonical,
                            stall_warning, pinning)  # R7 first
    check_int("prewarm", prewarm, minimum=0)
    return build_with_region(
        lambda r: CPUOffloadingWorker(backend, gpu_tensors, layout, blocks_per_chunk=blocks_per_chunk, region=r,
                                      policy=policy, pin_chunk_bytes=pin_chunk_bytes, require_pinned=require_pinned,
                                      prewarm=prewarm, compute_stream=compute_stream, canonical=options.canonical,
                                      stall_warning=stall_warning, pinning=options.pinning),
        backend, layout, blocks_per_chunk, num_cpu_chunks, region, check_canonical(layout, options.canonical),
        options.pinning)
