"""The sim's scheduler (``backends/_simsched.py``): ``run`` finishes the instant head a finish made ready without
the heap only when no heap entry comes before it, so every program finishes the same ops at the same times in the
same order as pushing each one and popping it back would -- with stops, limits, hangs and records waited on from
other streams."""

from __future__ import annotations

import random

import pytest

from kvoffload_ref.backends._simsched import HangOp, Op, Record, RecordOp, Scheduler, SimStream, SlowOp, WaitOp


class _Unchained(Scheduler):
    """The scheduler as it was before the chain: every instant head goes through the heap."""

    def _start_head(self, stream: SimStream, t: float) -> None:
        chaining, self._chaining = self._chaining, False
        try:
            super()._start_head(stream, t)
        finally:
            self._chaining = chaining


def _duration(op: Op) -> float:
    return op.duration if isinstance(op, SlowOp) else 0.0


def _play(scheduler_type: type[Scheduler], seed: int, halt_after: int | None = None) -> list[tuple[object, ...]]:
    """A random program of records, waits (on records of any stream, done or not), stalls and hangs on three
    streams, run to random limits (before the clock too) with random stops, the clock sometimes moved past queued
    work; returns what was observable: each finish (op number, time), each run's answer and the clock after it.
    ``halt_after``: the device halts once that many ops finished."""
    rng = random.Random(seed)
    seen: list[tuple[object, ...]] = []
    halted = None if halt_after is None else (lambda: sum(e[0] == "finish" for e in seen) >= halt_after)
    sched = scheduler_type(_duration, lambda op, t: None, halted)
    sched.trace = lambda op, t: seen.append(("finish", numbers[op], t))
    streams = [SimStream(None, f"s{k}") for k in range(3)]
    numbers: dict[Op, int] = {}
    records: list[Record] = []
    hangs: list[HangOp] = []
    for _ in range(rng.randrange(20, 60)):
        stream, roll = rng.choice(streams), rng.random()
        op: Op
        if roll < 0.45:
            record = Record(stream)
            records.append(record)
            op = RecordOp(stream, record)
        elif roll < 0.75 and records:
            op = WaitOp(stream, rng.choice(records))
        elif roll < 0.92:
            op = SlowOp(stream, None, rng.choice([1e-6, 2e-6, 5e-6]))
        else:
            op = HangOp(stream, None)
            hangs.append(op)
        numbers[op] = len(numbers)
        sched.submit(op)
        if rng.random() < 0.3:  # a poll pause (with stops), or a sleep (the clock then stands at its end)
            stops = set(rng.sample(records, min(len(records), rng.randrange(3)))) or None
            limit = sched.now + rng.choice([-2e-6, 0.0, 1e-6, 3e-6, 1e-5])  # at or before now too
            stopped = sched.run(limit, stops)
            if stops is None and rng.random() < 0.5:
                sched.now = max(sched.now, limit)
            seen.append(("run", stopped, sched.now))
        if rng.random() < 0.05:  # the clock moved past queued work without running it (as while halted)
            sched.now += 4e-6
        if hangs and rng.random() < 0.1:
            seen.append(("end_hang", sched.end_hang(hangs.pop(rng.randrange(len(hangs))))))
    for hang in hangs:
        sched.end_hang(hang)
    seen.append(("run", sched.run(sched.now + 1.0), sched.now))
    return seen


@pytest.mark.parametrize("seed", range(200))
def test_run_finishes_ops_in_heap_order_with_or_without_the_chain(seed: int) -> None:
    chained = _play(Scheduler, seed, halt_after=1 + seed % 40 if seed % 4 == 0 else None)
    assert chained == _play(_Unchained, seed, halt_after=1 + seed % 40 if seed % 4 == 0 else None)
    assert sum(1 for entry in chained if entry[0] == "finish") > 0


def test_a_stop_leaves_the_ready_head_in_the_heap() -> None:
    """A run that stops at a record leaves the next instant head queued (the heap has it: a later run finishes it
    at the stop's time), as before the chain."""
    sched = Scheduler(_duration, lambda op, t: None, None)
    stream = SimStream(None, "s")
    first, second = Record(stream), Record(stream)
    sched.submit(SlowOp(stream, None, 1e-6))
    sched.submit(RecordOp(stream, first))
    sched.submit(RecordOp(stream, second))
    assert sched.run(1.0, {first})
    assert first.done and not second.done and sched.now == 1e-6
    assert not sched.run(sched.now)
    assert second.done and second.done_at == 1e-6
