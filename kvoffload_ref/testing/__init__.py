"""kvoffload_ref's conformance kit: Hypothesis strategies, a pure model and a rule-based state machine.

Public and documented in docs/conformance.md. It needs ``hypothesis`` (installed by the ``test`` extra); the
library itself never imports this package.

* :mod:`~kvoffload_ref.testing.strategies`: layouts, valid and invalid transfers, faults, policies, setups.
* :mod:`~kvoffload_ref.testing.adapter`: what an implementation must offer (:class:`WorkerLike`, built by a
  :data:`WorkerFactory`), and the kit's device (:class:`SimDevice`).
* :mod:`~kvoffload_ref.testing.model`: the pure model run beside the worker.
* :mod:`~kvoffload_ref.testing.machine`: :class:`OffloadingMachine` and :func:`make_machine`.
* :mod:`~kvoffload_ref.testing.campaign`: :func:`run_campaign`, a fuzz campaign outside pytest.
"""

from kvoffload_ref.testing.adapter import (
    Capabilities,
    DeviceLike,
    Firing,
    RecordingPlan,
    ReportLike,
    ResultLike,
    Setup,
    SimDevice,
    WorkerFactory,
    WorkerLike,
    initial_gpu_bytes,
    reference_factory,
)
from kvoffload_ref.testing.machine import ConformanceError, Counters, OffloadingMachine, make_machine
from kvoffload_ref.testing.model import Model, plan_moves
from kvoffload_ref.testing.strategies import (
    INVALID_CASES,
    InvalidTransfer,
    fault_plans,
    faults,
    invalid_transfers,
    layouts,
    policies,
    setups,
    transfer_specs,
)

__all__ = [
    "INVALID_CASES",
    "Capabilities",
    "ConformanceError",
    "Counters",
    "DeviceLike",
    "Firing",
    "InvalidTransfer",
    "Model",
    "OffloadingMachine",
    "RecordingPlan",
    "ReportLike",
    "ResultLike",
    "Setup",
    "SimDevice",
    "WorkerFactory",
    "WorkerLike",
    "fault_plans",
    "faults",
    "initial_gpu_bytes",
    "invalid_transfers",
    "layouts",
    "make_machine",
    "plan_moves",
    "policies",
    "reference_factory",
    "setups",
    "transfer_specs",
]
