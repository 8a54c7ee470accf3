"""A fuzz campaign outside pytest: the conformance machine, driven by Hypothesis, for a number of steps.

``kvoffload-ref fuzz --steps N [--seed S] [--policy quarantine|release]`` calls :func:`run_campaign`. The
campaign runs the same :class:`~kvoffload_ref.testing.machine.OffloadingMachine` as the test suite, in batches
of examples, each batch seeded from the campaign's seed (so a seed repeats a campaign exactly), and prints a
progress line after each batch. On the first failure Hypothesis shrinks it; the campaign prints the falsifying
example -- with the runnable reproduction the machine noted -- and returns 1.
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

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.testing.adapter import Capabilities, WorkerFactory, reference_factory
from kvoffload_ref.testing.machine import OffloadingMachine, make_machine
from kvoffload_ref.testing.strategies import policies, setups

__all__ = ["STEPS_PER_EXAMPLE", "quiet_logs", "run_campaign"]

#: Rule steps per example (one worker's life).
STEPS_PER_EXAMPLE: Final = 50
#: Most examples per batch (a progress line follows every batch).
MAX_BATCH: Final = 200

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


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
                    database=None, derandomize=False, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])


def _machine(factory: WorkerFactory, policy: str | None, capabilities: Capabilities | None) -> type[OffloadingMachine]:
    if policy not in (None, "quarantine", "release"):
        raise ValueError(f"policy must be None, 'quarantine' or 'release', got {policy!r}")
    chosen = setups(policy=policies(on_unproven=(policy,))) if policy else setups()
    return make_machine(factory, name="CampaignMachine", setup_strategy=chosen, capabilities=capabilities,
                        factory_name=getattr(factory, "__name__", "factory"))


def _progress(machine: type[OffloadingMachine], goal: int, started: float) -> str:
    c = machine.counters
    seconds = max(time.perf_counter() - started, 1e-9)
    return (f"fuzz: steps {c.steps}/{goal}  {c.steps / seconds:,.0f} steps/s  {seconds:.1f} s  runs {c.runs}  "
            f"faults injected {c.faults_injected} (fired {c.faults_fired})  violations {c.violations}  "
            f"accepted release-policy hazards {c.hazards}  quarantined {c.quarantined}/{c.shutdowns}\n")


def run_campaign(steps: int, seed: int | None, policy: str | None, out: TextIO = sys.stdout, *,
                 factory: WorkerFactory = reference_factory, capabilities: Capabilities | None = None) -> int:
    """Run the conformance machine for at least ``steps`` rule steps.

    Args:
        steps: rule steps to run (each example is one worker's life of up to STEPS_PER_EXAMPLE steps).
        seed: the campaign's seed (None: a random one, printed so the campaign can be repeated).
        policy: "quarantine" or "release" to fuzz one shutdown policy, None to draw it per example.
        out: where progress lines and a failure's report go.
        factory: the implementation under test (default: kvoffload_ref's own worker).
        capabilities: the optional behaviours it has (default: all).

    Returns:
        0 if no rule was violated, 1 at the first violation (its shrunk reproduction is printed).

    Raises:
        ValueError: an unknown policy.
    """
    machine = _machine(factory, policy, capabilities)
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    batches = random.Random(seed)
    out.write(f"fuzz: {steps} steps, seed {seed}, policy {policy or 'drawn per example'}\n")
    started = time.perf_counter()
    with quiet_logs():
        while machine.counters.steps < steps:
            left = steps - machine.counters.steps
            examples = max(1, min(MAX_BATCH, -(-left // (STEPS_PER_EXAMPLE * 4 // 5))))
            run = hypothesis_seed(batches.getrandbits(64))(machine)
            try:
                _run_machine(run, settings=_settings(examples))
            except Exception as exc:  # a violated rule, or an implementation that raised where it must not
                out.write(_progress(machine, steps, started))
                first = machine.counters.first_failure_step
                out.write(f"fuzz: FAILED (seed {seed}) at step {first} (later steps: shrinking): {exc}\n")
                out.write("".join(traceback.format_exception(exc)))
                out.flush()
                return 1
            out.write(_progress(machine, steps, started))
            out.flush()
    out.write(f"fuzz: OK: {machine.counters.line()}\n")
    return 0
