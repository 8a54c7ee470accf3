"""A fuzz campaign outside pytest: the conformance machine, driven by Hypothesis, for a number of steps or seconds.

``kvoffload-ref fuzz [--factory module:callable] --steps N | --seconds T [--seed S] [--policy ...]`` calls
:func:`run_campaign` (``--jobs N``: :func:`kvoffload_ref.testing.jobs.run_jobs`, one campaign per process). The
campaign runs the same :class:`~kvoffload_ref.testing.machine.OffloadingMachine` as the test suite, in batches of
examples, each batch seeded from the campaign's seed (so a seed repeats a campaign exactly), and prints a progress
line after each batch. On the first failure Hypothesis shrinks it (for at most ``shrink_seconds``); the campaign
prints the falsifying example -- with the runnable reproduction the machine noted, which imports the factory it
names -- and returns 1.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Final, TextIO

from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.testing.adapter import Capabilities, WorkerFactory, reference_factory
from kvoffload_ref.testing.machine import Counters, OffloadingMachine, make_machine
from kvoffload_ref.testing.settings import DEFAULT_SHRINK_SECONDS, STEPS_PER_EXAMPLE, bounded_shrinking, kit_settings
from kvoffload_ref.testing.strategies import policies, setups

__all__ = ["REPRO_BEGIN", "REPRO_END", "STEPS_PER_EXAMPLE", "quiet_logs", "run_campaign"]

#: The lines around the shrunk reproduction a failed campaign prints last (save what is between them as a .py file).
REPRO_BEGIN: Final = "fuzz: reproduction (runnable Python, as is):"
REPRO_END: Final = "fuzz: end of reproduction"
#: Most examples per batch (a progress line follows every batch).
MAX_BATCH: Final = 200
#: Examples per batch of a campaign bounded in time (about a second each on one core).
TIMED_BATCH: Final = 20

# Typed alias: some Hypothesis releases annotate run_state_machine_as_test, others do not (mypy --strict either way).
_run_machine: Callable[..., None] = run_state_machine_as_test


@contextlib.contextmanager
def quiet_logs(name: str = "kvoffload_ref") -> Iterator[None]:
    """Silence a logger tree for the duration (fuzzing makes the library log every injected failure)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _machine(factory: WorkerFactory, policy: str | None, capabilities: Capabilities | None) -> type[OffloadingMachine]:
    if policy not in (None, "quarantine", "release"):
        raise ValueError(f"policy must be None, 'quarantine' or 'release', got {policy!r} (e.g. 'quarantine')")
    chosen = setups(policy=policies(on_unproven=(policy,))) if policy else setups()
    return make_machine(factory, name="CampaignMachine", setup_strategy=chosen, capabilities=capabilities)


def _progress(counters: Counters, goal: str, started: float, shrinks: bool = True) -> str:
    c = counters
    seconds = max(time.perf_counter() - started, 1e-9)
    return (f"fuzz: steps {c.steps}/{goal}  {c.steps / seconds:,.0f} steps/s  {seconds:.1f} s  runs {c.runs}  "
            f"faults injected {c.faults_injected} (fired {c.faults_fired})  violations {c.violations}"
            f"{c.shrinking(shrinks)}  accepted release-policy hazards {c.hazards}  "
            f"quarantined {c.quarantined}/{c.shutdowns}\n")


def _traceback(exc: BaseException) -> str:
    """The failure's traceback without the notes Hypothesis adds (its own copy of the steps: the kit prints the
    reproduction once, as a test)."""
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        return "".join(traceback.format_exception(exc))
    del exc.__notes__
    try:
        return "".join(traceback.format_exception(exc))
    finally:
        exc.__notes__ = notes


def _validate(steps: int | None, seconds: float | None) -> None:
    if (steps is None) == (seconds is None):
        raise ValueError(f"steps and seconds: expected exactly one (e.g. steps=2000 or seconds=60), got "
                         f"steps={steps!r}, seconds={seconds!r}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps!r} (e.g. 2000)")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r} (e.g. 60)")


def run_campaign(steps: int | None, seed: int | None, policy: str | None, out: TextIO | None = None, *,
                 factory: WorkerFactory = reference_factory, capabilities: Capabilities | None = None,
                 seconds: float | None = None, quiet: bool = True,
                 shrink_seconds: float | None = DEFAULT_SHRINK_SECONDS,
                 on_progress: Callable[[Counters], None] | None = None) -> int:
    """Run the conformance machine for at least ``steps`` rule steps, or for about ``seconds``.

    Args:
        steps: rule steps to run (each example is one worker's life of up to STEPS_PER_EXAMPLE steps); None
            when ``seconds`` bounds the campaign.
        seed: the campaign's seed (None: a random one, printed so the campaign can be repeated).
        policy: "quarantine" or "release" to fuzz one shutdown policy, None to draw it per example.
        out: where progress lines and a failure's report go (default: ``sys.stdout`` at call time).
        factory: the implementation under test (default: kvoffload_ref's own worker).
        capabilities: the optional behaviours it has (default: all).
        seconds: run batches until this many seconds have passed (instead of ``steps``).
        quiet: keep the ``kvoffload_ref`` loggers' lines off the output while it runs (the last
            ``logtail.KEEP`` of a failing run are printed with its report).
        shrink_seconds: how long Hypothesis may shrink a failure (None: Hypothesis's own bound; 0: not at all, the
            failure is reported as found).
        on_progress: called with the machine's counters after every batch.

    Returns:
        0 if no rule was violated, 1 at the first violation (its shrunk reproduction is printed).

    Raises:
        ValueError: an unknown policy, both or neither of ``steps`` and ``seconds``, or a bound below 1 step.
    """
    _validate(steps, seconds)
    out = out if out is not None else sys.stdout
    machine = _machine(factory, policy, capabilities)
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    batches = random.Random(seed)
    bound = f"{steps} steps" if steps is not None else f"{seconds:g} s"
    out.write(f"fuzz: {bound}, seed {seed}, policy {policy or 'drawn per example'}\n"
              f"fuzz: factory {machine.factory_name}\n")
    started = time.perf_counter()
    goal = str(steps) if steps is not None else "-"
    counters = machine.counters
    shrinks = shrink_seconds != 0
    machine.quiet_logs = quiet  # the library's lines are kept (the last logtail.KEEP) and shown with a failure

    def found(c: Counters) -> None:  # progress at once: what follows is shrinking, which prints nothing for a while
        out.write(_progress(c, goal, started, shrinks))
        out.flush()
        if on_progress is not None:
            on_progress(c)

    machine.on_first_violation = (found,)
    with bounded_shrinking(shrink_seconds if shrinks else None):
        while (counters.steps < steps) if steps is not None else (time.perf_counter() - started < (seconds or 0)):
            examples = TIMED_BATCH
            if steps is not None:
                examples = max(1, min(MAX_BATCH, -(-(steps - counters.steps) // (STEPS_PER_EXAMPLE * 4 // 5))))
            run = hypothesis_seed(batches.getrandbits(64))(machine)
            try:
                _run_machine(run, settings=kit_settings(examples, shrink=shrinks))
            except Exception as exc:  # a violated rule, or an implementation that raised where it must not
                out.write(_progress(counters, goal, started, shrinks))
                first = counters.first_failure_step
                after = "(later steps: shrinking)" if shrinks else "(reported as found, not shrunk)"
                out.write(f"fuzz: FAILED (seed {seed}) at step {first} {after}: {exc}\n")
                out.write(_traceback(exc))
                if machine.last_logs:
                    out.write(f"{machine.last_logs}\n")
                out.write(f"{REPRO_BEGIN}\n{machine.last_reproduction}{REPRO_END}\n")
                out.flush()
                return 1
            out.write(_progress(counters, goal, started, shrinks))
            out.flush()
            if on_progress is not None:
                on_progress(counters)
    out.write(f"fuzz: OK: {counters.line()}\n")
    return 0
