"""The ``kvoffload-ref bench`` command: performance figures, each a ratio to a baseline measured in the same run.

Theory of operation
-------------------
Absolute speeds move with the machine, so every figure is paired with a *reference* measured in the same process,
on the same data, right next to it, and the *ratio* of the two is what the goals are mostly about (machine noise
and machine speed cancel). All timings are real (wall) time, ``time.perf_counter``, best of N after a warm-up,
except the one figure explicitly on the simulated device's virtual clock. Sizes in the figure modules' docstrings
read [full run / ``quick=True``].

Module map (one module per figure group; :data:`FIGURE_GROUPS` runs them in this order):

* :mod:`~kvoffload_ref.bench.common` -- :class:`Result`, goals, sizes, the :class:`BenchRun` handed to each group,
  timing and log capture;
* :mod:`~kvoffload_ref.bench.planner` -- the copy planner against the plain placement rule, and its scaling;
* :mod:`~kvoffload_ref.bench.datapath` -- store + load through a worker on the sim against ``np.copyto``;
* :mod:`~kvoffload_ref.bench.calibration` -- the sim's ``h200`` cost profile against the figures recorded on an
  H200 (virtual clock), and the data path's real cost with a profile on;
* :mod:`~kvoffload_ref.bench.shutdown` -- shutdown past the deadline, and draining many completed transfers;
* :mod:`~kvoffload_ref.bench.fuzz` -- the conformance kit's steps/s (when Hypothesis is installed);
* :mod:`~kvoffload_ref.bench.overhead` -- the race detector (R20) and the worker's lock (R19) against the same
  code without them;
* :mod:`~kvoffload_ref.bench.running` -- a running engine (R26-R28): submission with blocks held, one reap
  expiring the head of a long queue, submission with a deadline;
* :mod:`~kvoffload_ref.bench.report` -- the markdown table and the machine description.

A new figure goes into the module of its group (or a new module with a ``figures(run: BenchRun) ->
list[Result]`` function), and is registered by adding that group to :data:`FIGURE_GROUPS`; its keys must be
stable (tests/test_bench.py lists them).

Log records the library emits (hung shutdowns log errors with tracebacks) are formatted into a buffer while the
bench runs, so their cost is measured but they do not clutter the output.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Final, TextIO, cast

from kvoffload_ref.bench import calibration, datapath, fuzz, overhead, planner, running, shutdown
from kvoffload_ref.bench.common import FULL, QUICK, BenchRun, Result, captured_logs
from kvoffload_ref.bench.report import finite, machine, render

__all__ = ["FIGURE_GROUPS", "FigureGroup", "Result", "missed_goals", "render", "run_bench"]


@dataclasses.dataclass(frozen=True)
class FigureGroup:
    """A group of figures: its name (the progress line) and what measures it."""

    name: str
    figures: Callable[[BenchRun], list[Result]]


#: The figure groups, in table order (fuzz after shutdown: the drain's submit rate is its baseline).
FIGURE_GROUPS: Final[tuple[FigureGroup, ...]] = (
    FigureGroup("planner", planner.figures),
    FigureGroup("sim data path", datapath.figures),
    FigureGroup("sim cost model", calibration.figures),
    FigureGroup("shutdown", shutdown.figures),
    FigureGroup("fuzz", fuzz.figures),
    FigureGroup("overhead of the race detector and the lock", overhead.figures),
    FigureGroup("running engine: holds, deadline expiry", running.figures),
)


def run_bench(json_path: str | None = None, quick: bool = False, out: TextIO | None = None,
              progress: TextIO | None = None) -> dict[str, object]:
    """Run every figure group, print the markdown report to ``out`` and write the JSON to ``json_path``.

    Args:
        json_path: where to write the results as JSON (None: do not write).
        quick: small sizes, for a smoke test (a few seconds).
        out: where the report goes (default: ``sys.stdout`` at call time).
        progress: where a line per figure group goes as it starts and ends (None: nowhere).

    Returns:
        ``{"quick", "elapsed_s", "machine", "results": [Result as dict, ...], "drain_profile": [...]}``, the same
        as the JSON.
    """
    run = BenchRun(QUICK if quick else FULL, quick)
    start = time.perf_counter()
    results: list[Result] = []
    with captured_logs():
        for number, group in enumerate(FIGURE_GROUPS, 1):
            _say(progress, f"bench: [{number}/{len(FIGURE_GROUPS)}] {group.name} ...")
            began = time.perf_counter()
            results += group.figures(run)
            _say(progress, f"bench: [{number}/{len(FIGURE_GROUPS)}] {group.name} done in "
                           f"{time.perf_counter() - began:.1f} s")
    doc = cast(dict[str, object], finite({
        "quick": quick, "elapsed_s": time.perf_counter() - start, "machine": machine(),
        "results": [dataclasses.asdict(r) for r in results], "drain_profile": run.drain_profile,
    }))
    (out or sys.stdout).write(render(doc))
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return doc


def missed_goals(doc: dict[str, object]) -> list[str]:
    """The keys of the results in a :func:`run_bench` document whose goal was missed (``met`` is False).

    Args:
        doc: what :func:`run_bench` returned.

    Returns:
        The keys, in table order (a figure without a goal, or not available, is never missed).
    """
    return [str(r["key"]) for r in cast(list[dict[str, object]], doc["results"]) if r["met"] is False]


def _say(stream: TextIO | None, line: str) -> None:
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()
