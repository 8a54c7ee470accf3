"""kvoffload_ref's conformance kit: Hypothesis strategies, a pure model and a rule-based state machine.

Public and documented in docs/conformance.md. It needs Hypothesis: the ``conformance`` extra (``pip install
"kvoffload_ref[conformance] @ <a checkout's path or VCS URL, or a wheel built from one>"``; the ``test`` extra brings
it too); without it, importing this package raises :class:`HypothesisMissing` (a ``ModuleNotFoundError``) whose
one-line message names the command that installs it (``pip install "hypothesis>=6.100"``). The library itself
never imports this package.

* :mod:`~kvoffload_ref.testing.strategies`: layouts, valid and invalid transfers, faults, policies, setups.
* :mod:`~kvoffload_ref.testing.adapter`: what an implementation must offer (:class:`WorkerLike`, built by a
  :data:`WorkerFactory`), and the kit's device (:class:`SimDevice`).
* :mod:`~kvoffload_ref.testing.model`: the pure model run beside the worker.
* :mod:`~kvoffload_ref.testing.machine`: :class:`OffloadingMachine` and :func:`make_machine`.
* :mod:`~kvoffload_ref.testing.campaign`: :func:`run_campaign`, a fuzz campaign outside pytest;
  :mod:`~kvoffload_ref.testing.jobs`: the same across processes (``kvoffload-ref fuzz --jobs``).
* :mod:`~kvoffload_ref.testing.settings`: the kit's Hypothesis settings and profiles (no explain phase).
* :mod:`~kvoffload_ref.testing.mutants`: deliberately wrong workers, to see a conformance set-up bite.

Importing the kit switches the library's lock check on for the process (:mod:`kvoffload_ref.lockcheck`, R19): in
every run of the kit -- the machine, the explorer, the campaigns -- a write of a worker's or a handler's state by a
thread the rule does not allow raises ``LockCheckError`` at the write.
"""

from kvoffload_ref import lockcheck  # the library's own (no Hypothesis needed)

# Then: fail with the one-line install hint when Hypothesis is missing (the rest imports it).
from kvoffload_ref.testing._requires import INSTALL_HINT, HypothesisMissing
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
from kvoffload_ref.testing.settings import (
    kit_settings,
    register_profiles,
    settings_for_ci,
    settings_for_dev,
    settings_for_fuzz,
    settings_for_hypofuzz,
)
from kvoffload_ref.testing.strategies import (
    INVALID_CASES,
    InvalidTransfer,
    fault_plans,
    faults,
    first_job_ids,
    invalid_transfers,
    layouts,
    policies,
    setups,
    transfer_specs,
)

lockcheck.enable()  # R19: the kit holds every worker to the lock rule (see above)

__all__ = [
    "INSTALL_HINT",
    "INVALID_CASES",
    "HypothesisMissing",
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
    "first_job_ids",
    "initial_gpu_bytes",
    "invalid_transfers",
    "kit_settings",
    "layouts",
    "make_machine",
    "plan_moves",
    "policies",
    "reference_factory",
    "register_profiles",
    "settings_for_ci",
    "settings_for_dev",
    "settings_for_fuzz",
    "settings_for_hypofuzz",
    "setups",
    "transfer_specs",
]
