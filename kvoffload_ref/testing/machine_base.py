"""The conformance machine's state and helpers: counters, the reproduction script, checks that fail the run.

:class:`MachineBase` holds what one run knows (the setup, the kit's device, the worker under test, the model, the
phase) and the helpers every rule uses; the rules (:mod:`~kvoffload_ref.testing.rules`,
:mod:`~kvoffload_ref.testing.shutdown_rules`) and the checks (:mod:`~kvoffload_ref.testing.invariants`) build on
it, and :class:`~kvoffload_ref.testing.machine.OffloadingMachine` puts them together.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from kvoffload_ref.errors import SimHang
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload_ref.testing.adapter import (
    Capabilities,
    Firing,
    ReportLike,
    Setup,
    SimDevice,
    WorkerFactory,
    WorkerLike,
    has_running_calls,
    reference_factory,
)
from kvoffload_ref.testing.logtail import LogTail
from kvoffload_ref.testing.model import Model
from kvoffload_ref.testing.races import RaceModel
from kvoffload_ref.testing.reproduction import REPRODUCTION_HEADING, as_test
from kvoffload_ref.testing.settings import DEFAULT_SHRINK_SECONDS
from kvoffload_ref.testing.strategies import (
    InvalidTransfer,
    setups,
)

__all__ = ["ConformanceError", "Counters", "MachineBase", "worker_open"]

logger = logging.getLogger("kvoffload_ref.testing")

#: A check's closing assertion in the script's terms: the expression, a maker called only on a failure, or None.
Asserts = str | Callable[[], str] | None


@dataclasses.dataclass
class Counters:
    """What a machine class has done, over all its runs (the CI summary and the campaign's progress line)."""

    runs: int = 0
    workers: int = 0
    steps: int = 0
    open_steps: int = 0
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    faults_injected: int = 0
    faults_fired: int = 0
    data_checks: int = 0
    shutdowns: int = 0
    drops: int = 0
    interrupts: int = 0
    quarantined: int = 0
    hazards: int = 0
    violations: int = 0
    races: int = 0
    ordered_waits: int = 0
    concurrent_shutdowns: int = 0
    orderings: int = 0
    ordered_edges: int = 0
    outcomes_checked: int = 0
    first_failure_step: int = 0
    refused_held: int = 0
    released: int = 0
    deadlines: int = 0
    cancels: int = 0
    expired: int = 0
    cancels_after_completion: int = 0

    def shrinking(self, shrinks: bool = True) -> str:
        """What a progress line adds once a violation was found ("" before): its step, and whether shrinking runs
        (``shrinks``: False for a campaign that reports its failure as found)."""
        first = self.first_failure_step
        return f" (first at step {first}; {'shrinking' if shrinks else 'not shrinking'})" if first else ""

    def line(self) -> str:
        """A one-line summary."""
        return " ".join(f"{field.name}={getattr(self, field.name)}" for field in dataclasses.fields(self))


class ConformanceError(AssertionError):
    """An observation contradicts a rule; the message names the rule ids."""


class MachineBase(RuleBasedStateMachine):
    """The conformance machine's state and helpers (no rules): see :mod:`kvoffload_ref.testing.machine`.

    Class attributes (set by :func:`make_machine`):
        worker_factory: builds the implementation under test.
        factory_name: how the reproduction header names the factory.
        factory_import: the reproduction's line importing the factory ("" when the kit's imports cover it).
        shrink_seconds: how long Hypothesis may shrink a failure (see ``settings.bounded_shrinking``).
        last_reproduction: the reproduction script of the last failing run ("" before any failure): a test file
            ending in the violated rule's assertion (``reproduction.as_test``).
        last_logs: the library's last log lines of the last failing run, its cleanup included ("" when it logged
            none).
        quiet_logs: keep the library's log lines (the last ``logtail.KEEP``) instead of passing them to the root
            logger, and show them only with a failure.
        on_first_violation: called with the counters when the first violation is found (the campaign's
            progress: what follows is shrinking).
        setup_strategy: what setups are drawn.
        capabilities: optional behaviours of the implementation.
        counters: totals over every run of this class.
        running_skipped: the kit said once that this class's worker lacks a running engine's calls.
    """

    worker_factory: ClassVar[tuple[WorkerFactory]] = (reference_factory,)
    factory_name: ClassVar[str] = "reference_factory"
    factory_import: ClassVar[str] = ""
    shrink_seconds: ClassVar[float | None] = DEFAULT_SHRINK_SECONDS
    last_reproduction: ClassVar[str] = ""
    last_logs: ClassVar[str] = ""
    quiet_logs: ClassVar[bool] = True
    on_first_violation: ClassVar[tuple[Callable[[Counters], None], ...]] = ()
    setup_strategy: ClassVar[st.SearchStrategy[Setup]] = setups()
    capabilities: ClassVar[Capabilities] = Capabilities()
    counters: ClassVar[Counters] = Counters()
    running_skipped: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.setup: Setup | None = None
        self.dev: SimDevice | None = None
        self.worker: WorkerLike | None = None
        self.model: Model | None = None
        # Invariant: the R20 model of the current device's ops (None before a worker is built).
        self.race: RaceModel | None = None
        # Invariant: how many of the current race model's races the counters hold.
        self.races_seen = 0
        self.report: ReportLike | None = None
        # Invariant: how many times get_finished() handed out each job of the current worker (R5, R22).
        self.handed: collections.Counter[int] = collections.Counter()
        # Invariant: "new" -> "open" -> "closed" (shutdown) | "dropped" (finalizer); "refused" (construction failed).
        self.phase = "new"
        # Invariant: True once a check or a call failed; teardown then only cleans up.
        self.failed = False
        self.lifetime = 0
        self.age = 0
        self.next_job = 1
        self.seen_firings = 0
        self.hazard_counted = False
        # Invariant: the current worker's running-engine calls (R26-R28) are checked: Capabilities.running and it
        # has them.
        self.running = False
        self.specs: st.SearchStrategy[tuple[GPULoadStoreSpec, CPULoadStoreSpec]] = st.nothing()
        self.invalid: dict[bool, st.SearchStrategy[InvalidTransfer]] = {}
        # Invariant: the reproduction so far, one Python line per entry; noted once, when the run fails.
        self.script: list[str] = []
        self.script_noted = False
        # Invariant: installed (the library's logs kept here) from construction to teardown when quiet_logs.
        self.logs = LogTail().install() if type(self).quiet_logs else None
        type(self).counters.runs += 1

    # -- helpers ------------------------------------------------------------------------------------------------
    @property
    def current_worker(self) -> WorkerLike:
        """The worker under test (only while one exists: a rule's precondition says so)."""
        assert self.worker is not None
        return self.worker

    @property
    def current_device(self) -> SimDevice:
        """The kit's device of the current worker."""
        assert self.dev is not None
        return self.dev

    @property
    def current_model(self) -> Model:
        """The model run beside the current worker."""
        assert self.model is not None
        return self.model

    @property
    def current_race(self) -> RaceModel:
        """The R20 model of the current device, with every observation the device recorded taken into it."""
        assert self.race is not None
        for label in self.current_device.take_observations():
            self.race.observe(label)
        return self.race

    def _make_device(self, setup: Setup) -> SimDevice:
        """The kit's device for a setup (a subclass may build it otherwise, e.g. with its race check off)."""
        return SimDevice(setup)

    @property
    def current_setup(self) -> Setup:
        """The setup the current worker was built from."""
        assert self.setup is not None
        return self.setup

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """Count one step; an exception marks the run failed (so teardown does not pile errors on it)."""
        counters = type(self).counters
        counters.steps += 1
        counters.open_steps += self.phase == "open"
        self.age += 1
        try:
            yield
        except (Exception, SimHang) as exc:
            self._fail("", f"{type(exc).__name__}: {exc}")
            raise
        except BaseException:  # Hypothesis' own control flow (an example cut short): not a failure
            self.failed = True
            raise

    def _say(self, line: str) -> None:
        """Note a line and append it to the reproduction script."""
        note(line)
        self.script.append(line)

    def _raised(self, error: str) -> None:
        """The call the script's last line makes raised ``error`` as allowed: wrap it so the script runs on."""
        last = self.script[-1].replace("\n", "\n    ")
        self.script[-1] = f"try:\n    {last}\nexcept {error}:\n    pass"
        note(f"# -> {error}")

    def _outcome(self, error: str) -> str:
        """Wrap the script's last call so ``raised`` names what it raised (``error``, caught) or None; the call's
        check then closes the script in those terms (e.g. ``raised is None``). Returns ``"raised"``."""
        last = self.script[-1].replace("\n", "\n    ")
        self.script[-1] = f"try:\n    {last}\nexcept {error} as exc:\n    raised = exc\nelse:\n    raised = None"
        return "raised"

    def _snapshot(self) -> str:
        """What a refused call must leave as it was (R7), as the script computes it: the ledger, the clock, the
        fired faults and the worker's stats (when it has them)."""
        stats = ", w.stats()" if self.capabilities.stats else ""
        return f"(dev.ledger.live(), dev.clock(), len(dev.plan.fired){stats})"

    def _before(self) -> str:
        """Note, just before the script's last call, what it must leave as it was (:meth:`_snapshot`, as
        ``before``); returns the check that it did."""
        self.script.insert(len(self.script) - 1, f"before = {self._snapshot()}")
        return f"{self._snapshot()} == before"

    def _fail(self, rules: str = "", message: str = "", asserts: str | None = None) -> None:
        """Mark the run failed and note the reproduction (once): a test ending in the violated rule's assertion.

        Args:
            rules: the violated rules' ids ("" when a call raised where it must not: the script ends at that call).
            message: what the check found.
            asserts: the check as a Python expression over the script's names, true when the rule holds.
        """
        self.failed = True
        cls = type(self)
        counters = cls.counters
        first = not counters.first_failure_step
        counters.first_failure_step = counters.first_failure_step or counters.steps
        if self.script_noted:
            return
        self.script_noted = True
        counters.violations += 1  # one per failing run: the first found, then each the shrinker tried
        # A call that raised where no rule lets it: the script raises at that call (and passes once it returns).
        script = as_test(self.script, rules or "the last call raised", message or "an exception",
                         asserts if rules else "True")
        cls.last_reproduction = script  # the last failing run: after shrinking, the shrunk one
        note(f"{REPRODUCTION_HEADING}\n{script}")
        if first:
            for hook in cls.on_first_violation:
                hook(counters)

    def _stop_logs(self) -> None:
        """Give the library's logger back (teardown); a failing run's last log lines are noted (and kept)."""
        if self.logs is not None:
            self.logs.remove()
            if self.script_noted:
                cls = type(self)
                cls.last_logs = self.logs.summary()
                if cls.last_logs:
                    note(cls.last_logs)

    def _check(self, ok: bool, rules: str, message: str, asserts: Asserts = None) -> None:
        """Fail the run with ``rules: message`` unless ``ok``; ``asserts`` is the check in the script's terms (or
        makes it, called only on a failure: it may add the lines the check needs to the script)."""
        if not ok:
            self._fail(rules, message, asserts() if callable(asserts) else asserts)
            raise ConformanceError(f"{rules}: {message}")

    def _problems(self, problems: Iterable[tuple[str, str, str]]) -> None:
        """Fail the run at the first problem: (rules, message, the check in the script's terms)."""
        for rules, message, asserts in problems:
            self._check(False, rules, message, asserts)

    def _fresh_job(self) -> int:
        job, self.next_job = self.next_job, self.next_job + 1
        return job

    def _id_pool(self, queued: Iterable[int]) -> list[int]:
        """The ids a ``cancel`` or ``order_after`` draws from: ``queued`` jobs, the last two reported, an unknown
        one (R23/R26: only the queued ones do anything)."""
        reported = [j for j, t in self.current_model.transfers.items() if t.status != "pending"][-2:]
        return [*queued, *reported, self.next_job + 50]

    def _new_firings(self) -> list[Firing]:
        firings = self.current_device.plan.firings[self.seen_firings:]
        self.seen_firings += len(firings)
        type(self).counters.faults_fired += len(firings)
        return firings

    def _absorb(self, firings: Sequence[Firing]) -> None:
        """Tell the model about errors that fired on transfers' end events (R5: they and those behind fail)."""
        for firing in firings:
            if firing.fault.kind == "error" and firing.point in ("event_query", "event_sync") and firing.tag:
                direction, job_id = firing.tag
                self.current_model.error_fired(direction, job_id)

    def _check_running(self) -> None:
        """Whether the new worker's running-engine calls are checked; says once per class when they are missing."""
        self.running = self.capabilities.running and has_running_calls(self.current_worker)
        if self.capabilities.running and not self.running and not type(self).running_skipped:
            type(self).running_skipped = True
            logger.warning("%s: the worker has no cancel/held/take_released: the kit skips the running-engine "
                           "checks (R26-R28; docs/conformance.md); pass Capabilities(running=False) to say so",
                           type(self).__name__)

    def _check_fresh_lane(self, direction: str, job: int, lane: str | None) -> None:
        """R28: an accepted job was not queued on a stream retired after a job on it became late (``lane``: the
        stream the device saw it queued on, None: unknown)."""
        retired = self.current_model.retired_lanes
        self._check(lane is None or lane not in retired, "R28",
                    f"{direction} job {job} was queued on stream {lane}, retired after a job on it became late",
                    lambda: f"dev.streams.get(({direction!r}, {job})) not in {sorted(retired)!r}")

    def _unreliable(self) -> bool:
        """The device was lost or saw misuse: queries may fail without a recorded firing."""
        return self.current_device.lost() or bool(self.current_device.violations())

    def _stats(self) -> object:
        return self.current_worker.stats() if self.capabilities.stats else None



def worker_open(machine: MachineBase) -> bool:
    """Precondition: a worker is built and not shut down or dropped."""
    return machine.phase == "open"
