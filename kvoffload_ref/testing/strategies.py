"""Hypothesis strategies for kvoffload_ref's inputs: layouts, valid and invalid transfers, faults, policies.

Every value drawn has a repr that is valid Python once ``from kvoffload_ref import *`` and
``from kvoffload_ref.testing import *`` ran, so a failing example can be pasted back.

The strategies are built once per distinct set of arguments (``functools.lru_cache``), not at every draw: a
strategy Hypothesis has not seen yet is validated (its whole tree) before its first draw, which cost more than the
draw itself (about a third of a fuzz step's time went to building and validating the setup's and the transfers'
strategies). A cached strategy is the same strategy: the examples drawn, for a given seed, are the same.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Final, Literal, TypeVar, cast

from hypothesis import strategies as st

from kvoffload_ref.faults import HANG_POINTS, POINTS, RELEASE_POINTS, Fault, FaultKind, FaultPoint
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.testing.adapter import Setup
from kvoffload_ref.worker import ShutdownPolicy

__all__ = [
    "INVALID_CASES",
    "InvalidTransfer",
    "completion_faults",
    "fault_plans",
    "faults",
    "first_job_ids",
    "invalid_transfers",
    "layouts",
    "policies",
    "setups",
    "transfer_specs",
]

Direction = Literal["store", "load"]
T = TypeVar("T")
SpecPair = tuple[GPULoadStoreSpec, CPULoadStoreSpec]

#: Shutdown timeouts drawn by default (virtual seconds): zero, shorter and longer than compute delays.
TIMEOUTS: Final = (0.0, 1e-3, 0.05, 0.5, 2.0)
#: Points a fault that only makes a submission fail can be armed at.
SUBMIT_POINTS: Final[tuple[FaultPoint, ...]] = ("copy", "stream_create", "event_create", "descriptor_alloc")
#: Points where an error makes a queued transfer fail: querying (or synchronizing) its end event.
COMPLETION_POINTS: Final[tuple[FaultPoint, ...]] = ("event_query", "event_query", "event_query", "event_sync")
#: Points a fault not aimed at a transfer is drawn at: transfer points, the proof, and every release step (their
#: calls carry no tag, so only an unaimed fault selects them: a failed release is leaked and reported, R16).
UNTARGETED_POINTS: Final[tuple[FaultPoint, ...]] = ("event_query", "copy", "device_sync", "host_unregister",
                                                    *RELEASE_POINTS)
#: Where a run's job ids start (they count up from there): 1, or just below an int64 edge, so that the run's ids
#: cross it (``2**63`` is reached from below, ``-2**63`` from ``-2**63 - 2``, a negative id). R7: a job id is any
#: int, only compared, hashed and printed; a worker that packs ids into a fixed-width integer (int64, or uint64)
#: fails there. Three values, the small one first: a failure shrinks to id 1 unless it needs an edge, and the
#: draw takes as much randomness as the ``(1, 1, 1000)`` it replaced (derandomized runs keep their course).
JOB_ID_STARTS: Final = (1, 2**63 - 2, -2**63 - 2)
#: Bound on each strategy cache (distinct argument sets; a campaign meets a few hundred layouts).
_CACHE_SIZE: Final = 4096


def _types(values: tuple[object, ...]) -> tuple[type, ...]:
    """Part of a cache key: the values' types (``0 == 0.0 == False`` hash alike, but draw differently)."""
    return tuple(map(type, values))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _sampled_cached(values: tuple[object, ...], types_key: tuple[type, ...]) -> st.SearchStrategy[object]:
    return st.sampled_from(values)


def _sampled(values: tuple[T, ...]) -> st.SearchStrategy[T]:
    return cast("st.SearchStrategy[T]", _sampled_cached(values, _types(values)))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _distinct(low: int, high: int, min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    """Lists of distinct ints in [low, high]."""
    return st.lists(st.integers(low, high), min_size=min_size, max_size=max_size, unique=True)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _page_lists(page_sizes: tuple[int, ...], types_key: tuple[type, ...],
                max_tensors: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.sampled_from(page_sizes), min_size=1, max_size=max_tensors)


def first_job_ids() -> st.SearchStrategy[int]:
    """The first job id of a run (see :data:`JOB_ID_STARTS`); the machine numbers its jobs up from it."""
    return _sampled(JOB_ID_STARTS)


@st.composite
def layouts(draw: st.DrawFn, *, max_tensors: int = 3, max_groups: int = 3,
            page_sizes: Sequence[int] = (8, 16, 24, 32, 64)) -> KVCacheLayout:
    """KV-cache layouts: 1..max_tensors tensors, 1..max_groups groups; refs copy the whole page or a padded
    prefix of it; a tensor appears at most once per group but may be shared by several groups."""
    pages = draw(_page_lists(tuple(page_sizes), _types(tuple(page_sizes)), max_tensors))
    groups = []
    for _ in range(draw(_integers(1, max_groups))):
        tensors = draw(_distinct(0, len(pages) - 1, 1, len(pages)))
        groups.append(tuple(LayerRef(t, draw(_sampled((pages[t], pages[t], max(1, pages[t] // 2), 1))))
                            for t in tensors))
    return KVCacheLayout(tensor_page_bytes=tuple(pages), groups=tuple(groups))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _layouts(max_tensors: int, max_groups: int) -> st.SearchStrategy[KVCacheLayout]:
    return layouts(max_tensors=max_tensors, max_groups=max_groups)


def policies(timeouts: Sequence[float] = TIMEOUTS,
             on_unproven: Sequence[str] = ("quarantine", "release")) -> st.SearchStrategy[ShutdownPolicy]:
    """Shutdown policies: a timeout from ``timeouts`` and an ``on_unproven`` from ``on_unproven``."""
    return _policies(tuple(timeouts), tuple(on_unproven), _types((*timeouts, *on_unproven)))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _policies(timeouts: tuple[float, ...], on_unproven: tuple[str, ...],
              types_key: tuple[type, ...]) -> st.SearchStrategy[ShutdownPolicy]:
    return st.builds(ShutdownPolicy, timeout=st.sampled_from(timeouts), on_unproven=st.sampled_from(on_unproven))


@st.composite
def _faults(draw: st.DrawFn, job_ids: tuple[int, ...], points: tuple[FaultPoint, ...], sticky: bool) -> Fault:
    point = draw(_sampled(points))
    kinds: tuple[FaultKind, ...] = ("error", "hang") if point in HANG_POINTS else ("error",)
    kind = draw(_sampled(kinds))
    direction = draw(_sampled((None, "store", "load")))
    job_id = draw(_sampled((None, *job_ids))) if job_ids else None
    nth = draw(_sampled((None, 1, 1, 2, 3)))
    lost = sticky and kind == "error" and draw(_integers(0, 9)) == 0
    return Fault(point, kind, direction=direction, job_id=job_id, nth=nth, sticky=lost)


def faults(job_ids: Sequence[int] = (), *, points: Sequence[FaultPoint] = POINTS,
           sticky: bool = True) -> st.SearchStrategy[Fault]:
    """One fault: a point, a kind (hangs only where they can be), and a selection by direction, job id and nth.

    Args:
        job_ids: ids a job selector may name (besides no selector).
        points: the points to draw from.
        sticky: whether sticky (device-lost) errors may be drawn (one in ten errors).
    """
    return _faults_for(tuple(job_ids), tuple(points), sticky, _types((*job_ids, *points, sticky)))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _faults_for(job_ids: tuple[int, ...], points: tuple[FaultPoint, ...], sticky: bool,
                types_key: tuple[type, ...]) -> st.SearchStrategy[Fault]:
    return _faults(job_ids, points, sticky)


def completion_faults(job_ids: Sequence[int] = ()) -> st.SearchStrategy[Fault]:
    """Errors at a transfer's completion: querying (mostly) or synchronizing an end event raises, so the transfer
    and those queued behind it must be reported ``success=False`` (R5) -- the path a worker that turns failures
    into successes gets wrong. Of uniform :func:`faults`, about one in nine is one (2 of 9 points, half of
    those hangs), and fewer are aimed where they fire; every draw here is one.

    Args:
        job_ids: ids the fault may be aimed at (it is aimed at one of them when any are given; else it selects by
            direction and ``nth`` only, e.g. the second end-event query of any store).
    """
    return _completion_faults(tuple(job_ids), _types(tuple(job_ids)))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _completion_faults(job_ids: tuple[int, ...], types_key: tuple[type, ...]) -> st.SearchStrategy[Fault]:
    job = st.sampled_from(job_ids) if job_ids else st.none()
    return st.builds(Fault, st.sampled_from(COMPLETION_POINTS), st.just("error"),
                     direction=st.sampled_from((None, None, "store", "load")) if not job_ids else st.none(),
                     job_id=job, nth=st.sampled_from((1, 1, 1, 2, None)))


def fault_plans(job_ids: Sequence[int] = (), *, max_faults: int = 3) -> st.SearchStrategy[tuple[Fault, ...]]:
    """The faults armed before a worker is built: a quarter of plans none; half start with an error at a
    transfer's completion (:func:`completion_faults`, the failure path R5 is about) and may add others; the
    rest are a few faults aimed at transfers (any point and kind, completion errors among them).

    Faults that are not aimed at a transfer (no direction or job id) are drawn at the transfer points, the proof and
    the release steps only (:data:`UNTARGETED_POINTS`), so a plan rarely breaks the worker's construction
    (prewarmed streams and events are untagged).
    """
    return _fault_plans(tuple(job_ids), max_faults, _types(tuple(job_ids)))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _fault_plans(job_ids: tuple[int, ...], max_faults: int,
                 types_key: tuple[type, ...]) -> st.SearchStrategy[tuple[Fault, ...]]:
    aimed = faults(job_ids)
    untargeted = faults((), points=UNTARGETED_POINTS).map(
        lambda f: dataclasses.replace(f, direction=None, job_id=None))
    completion = st.one_of(completion_faults(), completion_faults(job_ids)) if job_ids else completion_faults()
    some = st.lists(st.one_of(aimed, aimed, untargeted, completion), min_size=1, max_size=max_faults).map(tuple)
    failing = st.tuples(completion, st.lists(st.one_of(aimed, completion, untargeted), max_size=max_faults - 1)).map(
        lambda first: (first[0], *first[1]))
    return st.one_of(st.just(()), some, failing, failing)


@st.composite
def setups(draw: st.DrawFn, *, policy: st.SearchStrategy[ShutdownPolicy] | None = None,
           plans: st.SearchStrategy[tuple[Fault, ...]] | None = None, max_tensors: int = 3,
           max_groups: int = 3, schedules: Sequence[str] = ("racy", "ordered")) -> Setup:
    """Whole run setups: a layout, chunking, small tensors (padded GPU strides included), a policy, faults, and
    whether the machine draws racy or ordered schedules (``schedules``, see ``Setup.schedule``)."""
    layout = draw(_layouts(max_tensors, max_groups))
    return Setup(
        layout=layout,
        blocks_per_chunk=draw(_integers(1, 4)),
        num_gpu_blocks=draw(_integers(4, 16)),
        num_cpu_chunks=draw(_integers(2, 8)),
        gpu_row_pad=tuple(draw(_sampled((0, 0, 8, 24))) for _ in layout.tensor_page_bytes),
        policy=draw(policy if policy is not None else policies()),
        faults=draw(plans if plans is not None else fault_plans(range(1, 7))),
        pin_chunk_bytes=draw(_sampled((4096, 1 << 30))),
        seed=(seed := draw(_integers(0, 2**16))),
        # Chosen from the seed, not drawn: the choices made so far keep meaning what they meant.
        schedule=tuple(schedules)[seed % len(schedules)],
    )


def _group_shapes(draw: st.DrawFn, layout: KVCacheLayout, bpc: int, gpu_room: int,
                  cpu_room: int) -> tuple[list[int], list[int]]:
    """Per group, a size and a block index fitting the remaining GPU and CPU ids (an empty group's index is
    drawn up to ``bpc``: it must be ignored)."""
    sizes: list[int] = []
    indices: list[int] = []
    for _ in layout.groups:
        skip = draw(_integers(0, bpc - 1))
        most = min(gpu_room, max(0, cpu_room * bpc - skip), 6)
        n = draw(_integers(0, most))
        if n == 0:
            skip = draw(_integers(0, bpc))
        else:
            gpu_room -= n
            cpu_room -= -(-(n + skip) // bpc)
        sizes.append(n)
        indices.append(skip)
    return sizes, indices


@st.composite
def transfer_specs(draw: st.DrawFn, layout: KVCacheLayout, blocks_per_chunk: int, num_gpu_blocks: int,
                   num_cpu_chunks: int) -> SpecPair:
    """A valid (GPU spec, CPU spec) pair: any group sizes (empty groups included), block indices that skip
    sub-blocks at the start of the first chunk (and leave a partial last chunk), distinct in-range ids."""
    sizes, indices = _group_shapes(draw, layout, blocks_per_chunk, num_gpu_blocks, num_cpu_chunks)
    cpu_count = sum(-(-(n + i) // blocks_per_chunk) for n, i in zip(sizes, indices, strict=True) if n)
    gpu_count = sum(sizes)
    gpu_ids = draw(_distinct(0, num_gpu_blocks - 1, gpu_count, gpu_count))
    cpu_ids = draw(_distinct(0, num_cpu_chunks - 1, cpu_count, cpu_count))
    return GPULoadStoreSpec(gpu_ids, group_sizes=tuple(sizes), block_indices=tuple(indices)), \
        CPULoadStoreSpec(cpu_ids)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def specs_for(layout: KVCacheLayout, blocks_per_chunk: int, num_gpu_blocks: int,
              num_cpu_chunks: int) -> st.SearchStrategy[SpecPair]:
    """:func:`transfer_specs` for these arguments, built once (the machine draws from it at every submission)."""
    return transfer_specs(layout, blocks_per_chunk, num_gpu_blocks, num_cpu_chunks)


#: The R7 cases :func:`invalid_transfers` draws, by name.
INVALID_CASES: Final = (
    "swapped spec types", "not a spec", "non-1-D ids", "non-integer ids", "negative id", "gpu id out of range",
    "cpu id out of range", "gpu id count mismatch", "block_indices count mismatch", "cpu id count mismatch",
    "wrong number of groups", "block index out of range", "job id in flight", "job id not an int",
    "job id a float", "job id a bool",
)


@dataclasses.dataclass(frozen=True)
class InvalidTransfer:
    """One submission R7 says must raise InvalidTransferError (and change nothing).

    Attributes:
        case: which R7 case (one of :data:`INVALID_CASES`).
        direction: "store" or "load".
        gpu_ids, group_sizes, block_indices: the GPU spec's arguments (possibly malformed).
        cpu_ids: the CPU spec's argument (possibly malformed).
        job: "fresh" (a new id), "in_flight" (the machine passes a pending id), or a bad job id value.
        swap: pass each spec in the other's place.
        raw_src: pass a plain list instead of the source spec.
    """

    case: str
    direction: Direction
    gpu_ids: object
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    cpu_ids: object
    job: object = "fresh"
    swap: bool = False
    raw_src: bool = False

    def specs_text(self) -> tuple[str, str]:
        """Python source of (src, dst) as the submission passes them."""
        gpu = f"GPULoadStoreSpec({self.gpu_ids!r}, group_sizes={self.group_sizes!r}, " \
              f"block_indices={self.block_indices!r})"
        cpu = f"CPULoadStoreSpec({self.cpu_ids!r})"
        src, dst = (gpu, cpu) if self.direction == "store" else (cpu, gpu)
        if self.swap:
            src, dst = dst, src
        if self.raw_src:
            src = repr(self.gpu_ids if self.direction == "store" else self.cpu_ids)
        return src, dst

    def build(self) -> tuple[object, object]:
        """The (src, dst) objects. Constructing a malformed spec raises InvalidTransferError itself (R7)."""
        gpu = GPULoadStoreSpec(self.gpu_ids, group_sizes=self.group_sizes,  # type: ignore[arg-type]
                               block_indices=self.block_indices)
        cpu = CPULoadStoreSpec(self.cpu_ids)  # type: ignore[arg-type]
        src: object
        dst: object
        src, dst = (gpu, cpu) if self.direction == "store" else (cpu, gpu)
        if self.swap:
            src, dst = dst, src
        if self.raw_src:
            src = list(gpu.block_ids.tolist() if self.direction == "store" else cpu.block_ids.tolist())
        return src, dst


def _with_one(ids: list[int], value: object) -> list[object]:
    """``ids`` with its last entry replaced by ``value`` (or ``[value]`` if empty)."""
    return [*ids[:-1], value] if ids else [value]


def _mutate(case: str, base: InvalidTransfer, bpc: int, num_gpu: int, num_cpu: int) -> InvalidTransfer:
    """Turn a valid submission into the R7 case ``case``."""
    gpu = list(base.gpu_ids)  # type: ignore[call-overload]
    cpu = list(base.cpu_ids)  # type: ignore[call-overload]
    sizes, indices = base.group_sizes, base.block_indices
    edits: dict[str, dict[str, object]] = {
        "swapped spec types": {"swap": True},
        "not a spec": {"raw_src": True},
        "non-1-D ids": {"gpu_ids": [gpu]},
        "non-integer ids": {"gpu_ids": _with_one(gpu, 0.5)},
        "negative id": {"cpu_ids": _with_one(cpu, -1)},
        "gpu id count mismatch": {"gpu_ids": [*gpu, num_gpu + 1]},
        "block_indices count mismatch": {"block_indices": (*indices, 0)},
        "cpu id count mismatch": {"cpu_ids": cpu[:-1] if cpu else [0]},
        "wrong number of groups": {"group_sizes": (*sizes, 0), "block_indices": (*indices, 0)},
        "job id in flight": {"job": "in_flight"},
        "job id not an int": {"job": "7"},
        "job id a float": {"job": 7.0},
        "job id a bool": {"job": True},
    }
    if case in edits:
        return dataclasses.replace(base, case=case, **edits[case])  # type: ignore[arg-type]
    # The remaining cases need a non-empty group: use group 0 with one block.
    one_gpu, one_cpu = [num_gpu if case == "gpu id out of range" else 0], [
        num_cpu if case == "cpu id out of range" else 0]
    skip = bpc if case == "block index out of range" else 0
    group_sizes = (1,) + (0,) * (len(sizes) - 1)
    return dataclasses.replace(base, case=case, gpu_ids=one_gpu, cpu_ids=one_cpu, group_sizes=group_sizes,
                               block_indices=(skip,) + (0,) * (len(sizes) - 1))


@st.composite
def invalid_transfers(draw: st.DrawFn, layout: KVCacheLayout, blocks_per_chunk: int, num_gpu_blocks: int,
                      num_cpu_chunks: int, *, cases: Sequence[str] = INVALID_CASES) -> InvalidTransfer:
    """One submission that R7 says must raise InvalidTransferError: a valid one, broken in one way."""
    gpu_spec, cpu_spec = draw(specs_for(layout, blocks_per_chunk, num_gpu_blocks, num_cpu_chunks))
    base = InvalidTransfer("valid", draw(_sampled(("store", "load"))), gpu_spec.block_ids.tolist(),
                           gpu_spec.group_sizes, gpu_spec.block_indices, cpu_spec.block_ids.tolist())
    return _mutate(draw(_sampled(tuple(cases))), base, blocks_per_chunk, num_gpu_blocks, num_cpu_chunks)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def invalid_for(layout: KVCacheLayout, blocks_per_chunk: int, num_gpu_blocks: int, num_cpu_chunks: int,
                cases: tuple[str, ...]) -> st.SearchStrategy[InvalidTransfer]:
    """:func:`invalid_transfers` for these arguments, built once (the machine draws from it at every R7 step)."""
    return invalid_transfers(layout, blocks_per_chunk, num_gpu_blocks, num_cpu_chunks, cases=cases)
