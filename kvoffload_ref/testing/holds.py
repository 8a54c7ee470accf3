"""What the model knows about held blocks (R27): which submissions a hold refuses, what ``held()`` must list, and
which ``take_released()`` records are possible.

Theory of operation
-------------------
A store reads GPU blocks and writes CPU chunks; a load the reverse. A *late* copy (its job reported failed: an
error, an expiry, a cancel, or queued behind one, R26) may still run: what it writes is held for any access,
what it reads against writes (two reads never conflict, R20). ``held()`` lists every held id and, apart, those
held for writes only.

* :func:`conflict`: a submission writing a held id, or reading an id held for any access, must be refused
  (``BlocksHeldError``); any other must not be refused for holds.
* :func:`held_problems`: ``held()`` against the model. It must cover every late transfer not yet released (the
  model knows those: reported failed, no release handed out). It may hold more, but only for transfers that can
  be late without the model knowing yet -- pending ones (a ``wait()`` or ``cancel()`` may have ended them, their
  results not handed out yet) -- and only the way such a transfer touches each id.
* :func:`release_problems`: a ``take_released()`` record names a job the worker accepted, of its direction, with
  exactly its ids; not one reported a success, never one already released; and its copy was observed done on the
  device first (the kit's device saw a query of its end event return True).

Pure functions; the machine turns each problem into a failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvoffload_ref.testing.adapter import HeldLike, ReleasedLike
from kvoffload_ref.testing.model import Model, ModelTransfer
from kvoffload_ref.testing.reproduction import set_literal

__all__ = ["HeldSets", "conflict", "held_problems", "held_sets", "release_problems"]

#: (rule ids, message, the check as a reproduction asserts it: a Python expression over ``w``, the worker, and
#: ``released``, the last ``take_released()`` records, true when the rule holds)
Problem = tuple[str, str, str]
#: ``held()``'s fields per side: (every held id, the ids held for writes only).
_FIELDS = {"gpu": ("gpu_blocks", "gpu_blocks_writes_only"), "cpu": ("cpu_chunks", "cpu_chunks_writes_only")}
#: side ("gpu" | "cpu") -> (every held id, the ids held for writes only)
HeldSets = dict[str, tuple[frozenset[int], frozenset[int]]]


def held_sets(held: HeldLike) -> HeldSets:
    """``held()`` as sets per side."""
    return {side: (frozenset(map(int, getattr(held, every))), frozenset(map(int, getattr(held, writes))))
            for side, (every, writes) in _FIELDS.items()}


def _access(direction: str, gpu_ids: Iterable[int], cpu_ids: Iterable[int]) -> tuple[tuple[str, set[int]],
                                                                                     tuple[str, set[int]]]:
    """((side read, ids), (side written, ids)) of a transfer."""
    gpu, cpu = set(gpu_ids), set(cpu_ids)
    return (("gpu", gpu), ("cpu", cpu)) if direction == "store" else (("cpu", cpu), ("gpu", gpu))


def conflict(direction: str, gpu_ids: Sequence[int], cpu_ids: Sequence[int], held: HeldSets) -> str | None:
    """Why R27 refuses this submission given ``held`` (None: it does not)."""
    (read_side, reads), (write_side, writes) = _access(direction, gpu_ids, cpu_ids)
    every, writes_only = held[read_side]
    hit = sorted(reads & (every - writes_only))
    if hit:
        return f"it reads {read_side} ids {hit}, held for any access"
    every, _ = held[write_side]
    hit = sorted(writes & every)
    if hit:
        return f"it writes {write_side} ids {hit}, held"
    return None


def _held(side: str, writes_only: bool = False) -> str:
    """The ids ``w.held()`` lists on ``side`` (all, or those held for writes only), as the script reads them."""
    return f"set(map(int, w.held().{_FIELDS[side][writes_only]}))"


def _touched(transfers: Iterable[ModelTransfer]) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Per side: the ids the transfers touch (to hold at all), and those they write (to hold for any access)."""
    every: dict[str, set[int]] = {"gpu": set(), "cpu": set()}
    written: dict[str, set[int]] = {"gpu": set(), "cpu": set()}
    for transfer in transfers:
        (read_side, reads), (write_side, writes) = _access(transfer.direction, transfer.gpu_ids, transfer.cpu_ids)
        every[read_side] |= reads
        every[write_side] |= writes
        written[write_side] |= writes
    return every, written


def held_problems(held: HeldSets, model: Model) -> Iterator[Problem]:
    """``held()`` against the model (see the module docstring)."""
    for side, (every, writes_only) in held.items():
        if not writes_only <= every:
            yield ("R27", f"held() lists {side} ids {sorted(writes_only - every)} as held for writes only, not as held",
                   f"{_held(side, True)} <= {_held(side)}")
    must, must_any = _touched(model.holding())
    may, may_any = _touched([*model.holding(), *model.pending()])
    for side, (every, writes_only) in held.items():
        held_any = every - writes_only
        if not must[side] <= every:
            yield "R27", (f"{side} ids {sorted(must[side] - every)} are not held although a late copy (a job "
                          f"reported failed, its hold not released) may still touch them: {_jobs(model.holding())}"
                          ), f"{set_literal(must[side])} <= {_held(side)}"
        if not must_any[side] <= held_any:
            yield "R27", (f"{side} ids {sorted(must_any[side] - held_any)} are held for writes only although a late "
                          f"copy may still write them: {_jobs(model.holding())}"
                          ), f"{set_literal(must_any[side])} <= {_held(side)} - {_held(side, True)}"
        if not every <= may[side]:
            yield "R27", (f"{side} ids {sorted(every - may[side])} are held although no late (or possibly late) "
                          "copy touches them"), f"{_held(side)} <= {set_literal(may[side])}"
        if not held_any <= may_any[side]:
            yield "R27", (f"{side} ids {sorted(held_any - may_any[side])} are held for any access although no late "
                          "(or possibly late) copy writes them: they need only be held against writes"
                          ), f"{_held(side)} - {_held(side, True)} <= {set_literal(may_any[side])}"


def release_problems(record: ReleasedLike, model: Model, observed: bool) -> Iterator[Problem]:
    """One ``take_released()`` record against the model; ``observed``: the device saw its copy's end observed."""
    job = record.job_id
    absent = f"all(r.job_id != {job!r} for r in released)"  # the script's take_released() does not list it
    transfer = model.transfers.get(job)
    if transfer is None:
        yield "R27", f"take_released() handed out job {job!r}, which the worker never accepted", absent
        return
    what = f"take_released() handed out {transfer.direction} job {job}"
    if transfer.released:
        yield "R27", f"{what} a second time", absent
    if transfer.status == "succeeded":
        yield "R27", f"{what}, which was reported a success (only a late copy is held)", absent
    if record.direction != transfer.direction:
        yield ("R27", f"{what} as a {record.direction!r}",
               f"all(r.direction == {transfer.direction!r} for r in released if r.job_id == {job})")
    ids = (tuple(map(int, record.gpu_blocks)), tuple(map(int, record.cpu_chunks)))
    expected = (transfer.gpu_ids, transfer.cpu_ids)
    if ids != expected:
        yield ("R27", f"{what} with blocks {ids}, expected {expected}",
               f"all((tuple(map(int, r.gpu_blocks)), tuple(map(int, r.cpu_chunks))) == {expected!r} for r in released "
               f"if r.job_id == {job})")
    if not observed:
        # a release before the copy's end event was queried True (the device records every observation)
        yield "R27", (f"{what} although the device never saw its copy observed done (no query of its end event "
                      "returned True)"), f"{(transfer.direction, job)!r} in dev.observed()"


def _jobs(transfers: Iterable[ModelTransfer]) -> list[str]:
    return [f"{t.direction} {t.job_id}" for t in transfers]
