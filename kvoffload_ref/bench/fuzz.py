"""Bench figure of the conformance kit: stateful fuzz steps/s against the plain submit rate.

``kvoffload_ref.testing.campaign.run_campaign`` for [2000 / quick: 100] steps, seed 0, policy drawn per example,
against the rate of plain submissions measured by the drain figure. The value is steps per second of wall time,
like every figure; the note adds the rate per second of the process's CPU time, which another busy process on
the machine changes less (the campaign is one thread). The kit needs Hypothesis (the ``conformance`` extra);
without it the figure is reported as not available, with the kit's install hint.
"""

from __future__ import annotations

import importlib.util
import io
import time
from collections.abc import Callable
from typing import Final, cast

from kvoffload_ref.bench.common import BenchRun, Goal, Result, Sizes, result

__all__ = ["GOAL_FUZZ_RATE", "bench_fuzz", "figures"]

#: What a missing Hypothesis is reported with.
INSTALL_HINT: Final = 'pip install "hypothesis>=6.100"'
#: Goal (issue 6, item 4).
GOAL_FUZZ_RATE: Final = 500.0



def _campaign() -> tuple[Callable[..., int] | None, str]:
    """``run_campaign`` from the conformance kit when Hypothesis is installed, else None and the install hint.

    The kit itself is always part of the package; what may be missing is Hypothesis, its one dependency.
    """
    if importlib.util.find_spec("hypothesis") is None:
        return None, f"not available: Hypothesis is not installed ({INSTALL_HINT})"
    from kvoffload_ref.testing.campaign import run_campaign  # noqa: PLC0415  (needs Hypothesis)

    return cast(Callable[..., int], run_campaign), ""


def bench_fuzz(sizes: Sizes, submit_rate: float) -> Result:
    """Stateful fuzz steps/s (when Hypothesis is installed), against the plain submit rate."""
    steps, goal = sizes.fuzz_steps, f">= {GOAL_FUZZ_RATE:.0f} steps/s"
    metric = f"stateful fuzz, {steps} steps"
    reference = (submit_rate, "transfers/s", "plain submits (drain setup)")
    run, why = _campaign()
    if run is None:
        return Result("fuzz", metric, None, "steps/s", submit_rate, reference[1], reference[2], None, goal, None,
                      why)
    start, cpu_start = time.perf_counter(), time.process_time()
    status = run(steps, 0, None, out=io.StringIO())
    seconds, cpu = time.perf_counter() - start, max(time.process_time() - cpu_start, 1e-9)
    return result("fuzz", metric, (steps / seconds, "steps/s"), reference, goal,
                   [Goal("value", ">=", GOAL_FUZZ_RATE)],
                   note=f"seed 0, policy drawn; campaign exit status {status}; {steps / cpu:,.0f} steps/s of "
                        "process CPU time")



def figures(run: BenchRun) -> list[Result]:
    """The fuzz figure group: ``fuzz`` (after the shutdown group, whose submit rate is its baseline)."""
    return [bench_fuzz(run.sizes, run.submit_rate)]
