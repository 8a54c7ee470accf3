"""What every bench figure shares: the run's sizes, the result type and its goals, timing and log capture.

A figure group (one module of :mod:`kvoffload_ref.bench`) turns a :class:`BenchRun` into :class:`Result` lines;
``kvoffload_ref.bench.FIGURE_GROUPS`` lists the groups in table order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.specs import GPULoadStoreSpec

__all__ = [
    "BPC", "FULL", "KiB", "LAYERS", "MiB", "QUICK", "BenchRun", "Goal", "Result", "Sizes", "best_of",
    "captured_logs", "label", "one_group_gpu_spec", "result",
]

I64 = npt.NDArray[np.int64]
KiB: Final = 1024
MiB: Final = 1024 * KiB

#: The realistic layout of the planner and data-path measurements.
LAYERS: Final = 32
BPC: Final = 4


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the full run or the quick smoke run."""

    planner: tuple[int, int, int]  # descriptors: small, medium, large
    datapath_bytes: int  # per direction (at least one job)
    job_blocks: int  # blocks per data-path job
    drain_transfers: int
    drain_runs: int
    fuzz_steps: int
    repeats: int  # best-of for the data path and the hung shutdown


FULL: Final = Sizes((1024, 65536, 655360), 64 * MiB, 64, 10_000, 3, 2000, 7)
QUICK: Final = Sizes((1024, 8192, 81920), 8 * MiB, 16, 1000, 1, 100, 2)


@dataclasses.dataclass
class BenchRun:
    """One run of the bench, handed to every figure group in turn.

    Attributes:
        sizes: FULL or QUICK.
        quick: whether this is the quick smoke run.
        submit_rate: plain submissions per second, measured by the drain figure (the fuzz figure's baseline);
            0.0 until the drain figure ran.
        drain_profile: the cProfile top cost centers of one drain shutdown (filled by the drain figure).
    """

    sizes: Sizes
    quick: bool
    # Invariant: 0.0 until the shutdown group measured it, then > 0.
    submit_rate: float = 0.0
    # Invariant: empty until the shutdown group profiled a drain shutdown.
    drain_profile: list[dict[str, object]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Goal:
    """One condition on a result: ``field op threshold`` (field "value" or "ratio")."""

    field: Literal["value", "ratio"]
    op: Literal[">=", "<="]
    threshold: float

    def holds(self, value: float | None, ratio: float | None) -> bool:
        """Whether the condition holds for a result's value and ratio (never for a missing or NaN figure)."""
        got = value if self.field == "value" else ratio
        if got is None or math.isnan(got):
            return False
        return got >= self.threshold if self.op == ">=" else got <= self.threshold


@dataclasses.dataclass(frozen=True)
class Result:
    """One line of the table.

    Attributes:
        key: a stable identifier (the same in quick and full runs).
        metric: what was measured, with its size.
        value: the measured figure (None when not available), in ``unit``.
        unit: "descriptors/s", "bytes/s", "s" (real), "virtual s" (the sim's clock), "steps/s" or "transfers/s".
        reference: the same-run baseline, in ``reference_unit``.
        reference_unit: the baseline's unit.
        reference_label: what the baseline is.
        ratio: value / reference (dimensionless; None when not available).
        goal: the goal, in words.
        met: whether every goal condition holds (None: no goal, or not available).
        note: anything a reader needs to interpret the line.
    """

    key: str
    metric: str
    value: float | None
    unit: str
    reference: float | None
    reference_unit: str
    reference_label: str
    ratio: float | None
    goal: str
    met: bool | None
    note: str = ""


def result(key: str, metric: str, measured: tuple[float, str], reference: tuple[float, str, str],
           goal: str, conditions: Sequence[Goal], note: str = "") -> Result:
    """A result whose ratio is measured / reference; ``met`` is None when there are no conditions.

    Args:
        key: the stable key.
        metric: what was measured.
        measured: (value, unit).
        reference: (value, unit, label) of the same-run baseline.
        goal: the goal in words.
        conditions: the goal as conditions (empty: no goal).
        note: what a reader needs to interpret the line.

    Returns:
        The result line.
    """
    value, unit = measured
    ref, ref_unit, ref_label = reference
    ratio = value / ref if ref > 0 else math.inf
    met = all(c.holds(value, ratio) for c in conditions) if conditions else None
    return Result(key, metric, value, unit, ref, ref_unit, ref_label, ratio, goal, met, note)


def best_of(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The shortest real time of ``repeats`` calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def captured_logs() -> Iterator[io.StringIO]:
    """Format the package's log records into a buffer (their cost stays in the timings) instead of stderr."""
    logger = logging.getLogger("kvoffload_ref")
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def label(n: int) -> str:
    """``n`` as "64k" when a multiple of 1024, else as is."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def one_group_gpu_spec(rows: I64) -> GPULoadStoreSpec:
    """A GPU spec of ``rows`` in one KV-cache group, entered at the start of the first chunk."""
    return GPULoadStoreSpec(rows, [len(rows)], [0])
