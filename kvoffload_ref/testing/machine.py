"""OffloadingMachine: a Hypothesis rule-based state machine that drives a worker and a pure model side by side.

Theory of operation
-------------------
``initialize`` draws a :class:`~kvoffload_ref.testing.adapter.Setup`, builds the kit's device (a simulated GPU
with a recording fault plan) and the implementation under test through the machine's worker factory, and starts
a :class:`~kvoffload_ref.testing.model.Model`. Each rule does one thing to the worker or the device, tells the
model what happened, and checks what the rules R1-R23 say must be observable right then; the invariants run
after every step. The model predicts *constraints* (which jobs may never succeed, which bytes are settled, when
release must or must not happen), never timing.

Every rule ``note()``-s the Python line that repeats it on a real worker (``w`` is the worker, ``dev`` the
device) and appends it to a script that starts with the lines rebuilding the setup; when a run fails, the whole
script is noted as one block, so a failing example prints a runnable reproduction.

The release policy: ``on_unproven="release"`` reproduces vLLM #51622 and *accepts* use-after-free when memory
could not be proven idle. The machine therefore accepts sim violations under that policy only once shutdown
(or the finalizer) ran, and only when the report admits that the device-level proof did not succeed
(``device_sync`` "timeout" or "failed"; for a dropped worker: when the model could not predict a release).
Those are counted as ``hazards``. Any violation under "quarantine", or before shutdown, fails.

Use :func:`make_machine` (or ``OffloadingMachine.for_factory``) to check another implementation;
``OffloadingMachine`` checks kvoffload_ref itself.
"""


from __future__ import annotations

import contextlib
import unittest
from typing import Any

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvoffload_ref.errors import SimHang
from kvoffload_ref.testing.adapter import (
    Capabilities,
    Setup,
    WorkerFactory,
    reference_factory,
)
from kvoffload_ref.testing.cancel_rules import CancelRules
from kvoffload_ref.testing.concurrent_rules import ConcurrentRules
from kvoffload_ref.testing.invariants import Checks
from kvoffload_ref.testing.machine_base import ConformanceError, Counters, MachineBase
from kvoffload_ref.testing.ordering_rules import OrderingRules
from kvoffload_ref.testing.reproduction import report_once
from kvoffload_ref.testing.rules import TransferRules
from kvoffload_ref.testing.settings import bounded_shrinking, kit_settings
from kvoffload_ref.testing.shutdown import (
    MARGIN,
    SLACK,
)
from kvoffload_ref.testing.shutdown_rules import ShutdownRules
from kvoffload_ref.testing.strategies import (
    setups,
)

__all__ = ["MARGIN", "SLACK", "ConformanceError", "Counters", "OffloadingMachine", "factory_import", "make_machine"]


class OffloadingMachine(CancelRules, OrderingRules, ConcurrentRules, ShutdownRules, TransferRules, Checks,
                        MachineBase, RuleBasedStateMachine):
    """Drives one worker (built by ``worker_factory``) on the kit's simulated device; see the module docstring.

    Composed of independent mixins over :class:`~kvoffload_ref.testing.machine_base.MachineBase` (the state and
    helpers), one per file: the rules in :mod:`~kvoffload_ref.testing.rules` (``TransferRules``),
    :mod:`~kvoffload_ref.testing.cancel_rules` (``CancelRules``, R26),
    :mod:`~kvoffload_ref.testing.shutdown_rules` (``ShutdownRules``), :mod:`~kvoffload_ref.testing.
    concurrent_rules` (``ConcurrentRules``) and :mod:`~kvoffload_ref.testing.ordering_rules` (``OrderingRules``),
    the checks and invariants in :mod:`~kvoffload_ref.testing.invariants` (``Checks``). Hypothesis collects the
    rules and invariants from the whole MRO.
    """

    @classmethod
    def for_factory(cls, worker_factory: WorkerFactory, **options: Any) -> type[OffloadingMachine]:
        """``make_machine(worker_factory, **options)``: a machine class for another implementation.

        Args:
            worker_factory: builds the implementation under test.
            **options: the keyword arguments of :func:`make_machine`.

        Returns:
            The machine class (its ``.TestCase`` runs it under pytest).
        """
        return make_machine(worker_factory, **options)

    def teardown(self) -> None:
        """Always shut down (checked like the rule unless the run already failed) and check the ledger (R16)."""
        try:
            self._teardown()
        finally:
            self._stop_logs()

    def _teardown(self) -> None:
        if self.phase == "open" and self.worker is not None:
            if self.failed:  # only clean up: the run already reported its failure
                with contextlib.suppress(Exception, SimHang):
                    self.worker.shutdown()
                return
            self._say("start = dev.clock()\nreport = w.shutdown()  # teardown")
            self._shutdown()
        if not self.failed and self.dev is not None:
            self.no_violation()
            self.ledger_balances()


def factory_import(worker_factory: WorkerFactory) -> tuple[str, str]:
    """How a reproduction script names a factory: (the import line, or "" when it cannot be imported by name; the
    name to call it by).

    Args:
        worker_factory: a module-level callable (importable by name), or any other callable.

    Returns:
        ``("from pkg.mod import fn", "fn")`` for a module-level function or class, else ``("", its __name__)``.
    """
    module = getattr(worker_factory, "__module__", None)
    qualname = str(getattr(worker_factory, "__qualname__", None) or getattr(worker_factory, "__name__", "factory"))
    if not module or module == "__main__" or "<" in qualname:
        return "", str(getattr(worker_factory, "__name__", "factory"))
    return f"from {module} import {qualname.split('.', 1)[0]}", qualname


def make_machine(worker_factory: WorkerFactory = reference_factory, *, name: str = "OffloadingMachine",
                 factory_name: str | None = None, setup_strategy: st.SearchStrategy[Setup] | None = None,
                 capabilities: Capabilities | None = None,
                 settings: hypothesis.settings | None = None) -> type[OffloadingMachine]:
    """A machine class checking the implementation ``worker_factory`` builds.

    Args:
        worker_factory: (backend, GPU tensors, setup) -> a worker (see ``adapter.WorkerLike``).
        name: the class name (shown in failures).
        factory_name: how the reproduction names the factory (default: its qualified name, imported by the
            script when the factory is a module-level callable).
        setup_strategy: setups to draw (default: ``strategies.setups()``).
        capabilities: optional behaviours the implementation has.
        settings: the settings of the class's ``TestCase`` (default: :func:`~kvoffload_ref.testing.settings.
            kit_settings`, which skips Hypothesis's slow explain phase).

    Returns:
        A new subclass of :class:`OffloadingMachine` with its own ``counters``. Its ``.TestCase`` is a
        ``unittest.TestCase`` to assign at module level in a test file (``TestMyWorker = Machine.TestCase``):
        pytest runs it, and HypoFuzz (``hypothesis fuzz``) finds it.
    """
    import_line, called = factory_import(worker_factory)
    attrs = {
        "worker_factory": (worker_factory,),
        "factory_name": factory_name or called,
        "factory_import": import_line if factory_name is None else "",
        "setup_strategy": setup_strategy if setup_strategy is not None else setups(),
        "capabilities": capabilities or Capabilities(),
        "counters": Counters(),
        "last_reproduction": "",
        "last_logs": "",
        "on_first_violation": (),
    }
    machine: type[OffloadingMachine] = type(name, (OffloadingMachine,), attrs)
    case = _bounded_test_case(machine, settings if settings is not None else kit_settings())
    # The class attribute shadows Hypothesis's TestCase property (which refuses assignment on an instance).
    setattr(machine, "TestCase", case)  # noqa: B010
    return machine


def _bounded_test_case(machine: type[OffloadingMachine], chosen: hypothesis.settings) -> type[unittest.TestCase]:
    """Hypothesis's TestCase for ``machine``, its run wrapped in :func:`bounded_shrinking` (the markers that
    let pytest plugins and HypoFuzz recognise a Hypothesis test are kept)."""
    base = machine.TestCase  # Hypothesis's, built for this class

    class ConformanceTestCase(base):  # type: ignore[misc,valid-type]
        settings = chosen

        def runTest(self) -> None:
            # The reproduction is printed once: at normal verbosity Hypothesis's own listing of the steps (and
            # its shrink-deadline warning, which bounded shrinking trips) is turned off, and the kit's report is
            # printed in place of the failure's notes (reproduction.report_once). A verbosity the user raised is left
            # as it is.
            chosen = self.settings
            if chosen.verbosity == hypothesis.Verbosity.normal:
                chosen = hypothesis.settings(chosen, verbosity=hypothesis.Verbosity.quiet)
            machine.last_reproduction, machine.last_logs = "", ""
            try:
                with bounded_shrinking(machine.shrink_seconds):
                    run_state_machine_as_test(machine, settings=chosen)
            except BaseException as exc:
                # a failure without the kit's reproduction (Hypothesis's own errors, e.g. a flaky test) keeps its notes
                if chosen.verbosity == hypothesis.Verbosity.quiet and machine.last_reproduction:
                    report_once(exc, machine.last_reproduction, machine.last_logs)
                raise

    ConformanceTestCase.runTest.__dict__.update(base.runTest.__dict__)
    ConformanceTestCase.__name__ = f"{machine.__name__}.TestCase"
    ConformanceTestCase.__qualname__ = f"{machine.__qualname__}.TestCase"
    return ConformanceTestCase
