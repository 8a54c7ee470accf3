"""The simulated device as a DMA race detector (R20): racy schedules flagged, ordered ones clean, by
happens-before (never by timing); and the detector's verdict equals a naive pairwise model's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend

PAGE = 64
BLOCKS = 32


def rig(bpc: int, groups: int = 1, *, race_check: bool = True) -> tuple[SimBackend, kv.CPUOffloadingWorker,
                                                                           list[Any]]:
    """A worker over 2 tensors per group (K and V), ``groups`` groups, on a fresh sim."""
    be = SimBackend(race_check=race_check)
    tensors = 2 * groups
    layout = kv.KVCacheLayout((PAGE,) * tensors,
                              tuple(tuple(kv.LayerRef(2 * g + k, PAGE) for k in range(2)) for g in range(groups)))
    gpu = [be.from_host(np.full((BLOCKS, PAGE), t + 1, dtype=np.uint8)) for t in range(tensors)]
    worker = kv.create_worker(be, gpu, layout, blocks_per_chunk=bpc, num_cpu_chunks=16,
                              policy=kv.ShutdownPolicy(timeout=1.0))
    return be, worker, gpu


def gspec(ids: Sequence[int], groups: int = 1) -> kv.GPULoadStoreSpec:
    """The same ids in every group (index 0)."""
    return kv.GPULoadStoreSpec(list(ids) * groups, (len(ids),) * groups, (0,) * groups)


def cspec(nblocks: int, bpc: int, first: int, groups: int = 1) -> kv.CPULoadStoreSpec:
    """Chunks for ``nblocks`` blocks per group, group g starting at chunk ``first + g * per``."""
    per = -(-nblocks // bpc)
    return kv.CPULoadStoreSpec([first + g * per + c for g in range(groups) for c in range(per)])


def races(be: SimBackend) -> list[kv.backends.sim.Violation]:
    return [v for v in be.violations if v.kind == "dma_race"]


SHAPES = pytest.mark.parametrize(("bpc", "groups"), [(1, 1), (3, 1), (2, 3)], ids=["bpc1", "bpc3", "bpc2-3groups"])


# -- ordered schedules: never flagged ---------------------------------------------------------------------------


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_fifo_orders_a_handlers_transfers(bpc: int, groups: int) -> None:
    be, w, _ = rig(bpc, groups)
    for job in range(6):   # the same blocks into the same chunks, back to back: WAW on chunks, ordered by R4
        w.submit_store(job, gspec([1, 2, 3], groups), cspec(3, bpc, 0, groups))
    for job in range(6, 9):   # and the same chunks into the same blocks
        w.submit_load(job, cspec(3, bpc, 0, groups), gspec([4, 5, 6], groups))
    w.wait(range(9))
    w.shutdown()
    # the loads read chunks the stores write, unordered: that is the caller's race, the stores' FIFO is not
    assert all("store job" in v.detail and "load job" in v.detail for v in races(be))
    assert not any(v.detail.count("store job") == 2 or v.detail.count("load job") == 2 for v in races(be))


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_fifo_alone_is_clean(bpc: int, groups: int) -> None:
    be, w, _ = rig(bpc, groups)
    for job in range(6):
        w.submit_store(job, gspec([1, 2, 3], groups), cspec(3, bpc, 0, groups))
    w.wait(range(6))
    for job in range(6, 12):
        w.submit_load(job, cspec(3, bpc, 0, groups), gspec([1, 2, 3], groups))
    w.wait(range(6, 12))
    w.shutdown()
    assert races(be) == []


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_compute_wait_orders_compute_before_transfers(bpc: int, groups: int) -> None:
    be, w, gpu = rig(bpc, groups)
    be.enqueue_compute_write(gpu[0], [1, 2], 7, delay=5.0)   # still running when the store is submitted
    w.submit_store(1, gspec([1, 2], groups), cspec(2, bpc, 0, groups))
    w.wait({1})
    w.submit_load(2, cspec(2, bpc, 0, groups), gspec([1, 2], groups))
    w.wait({2})
    be.enqueue_compute_write(gpu[0], [1, 2], 9, delay=0.0)   # after the observed load: ordered
    w.shutdown()
    assert races(be) == []


@pytest.mark.rule("R20")
@SHAPES
@pytest.mark.parametrize("observe", ["wait", "get_finished"])
def test_sim_race_observation_orders_later_work(bpc: int, groups: int, observe: str) -> None:
    be, w, gpu = rig(bpc, groups)
    w.submit_store(1, gspec([1, 2], groups), cspec(2, bpc, 0, groups))
    if observe == "wait":
        w.wait({1})
    else:
        be.sleep(1.0)
        assert [r.job_id for r in w.get_finished()] == [1]
    w.submit_load(2, cspec(2, bpc, 0, groups), gspec([1, 2], groups))   # reads the chunks, writes the blocks
    if observe == "wait":
        w.wait({2})
    else:
        be.sleep(1.0)
        assert [r.job_id for r in w.get_finished()] == [2]
    be.enqueue_compute_write(gpu[1], [1, 2], 3, delay=0.0)
    w.shutdown()
    assert races(be) == []


# -- racy schedules: flagged, naming both ------------------------------------------------------------------------


@pytest.mark.rule("R20")
@SHAPES
@pytest.mark.parametrize("timing", ["overlapping", "already_done"])
def test_sim_race_load_writes_gpu_rows_a_pending_store_reads(bpc: int, groups: int, timing: str) -> None:
    be, w, _ = rig(bpc, groups)
    w.submit_store(1, gspec([1, 2], groups), cspec(2, bpc, 0, groups))
    if timing == "already_done":
        be.sleep(10.0)   # the store has run, but nobody observed it: still a race (happens-before, not timing)
    w.submit_load(2, cspec(2, bpc, 4, groups), gspec([2, 9], groups))   # WAR on GPU block 2
    found = races(be)
    assert found and all(v.tag == ("load", 2) for v in found)
    assert "load job 2 writes device array" in found[0].detail and "store job 1" in found[0].detail
    assert "row 2" in found[0].detail
    w.shutdown()


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_load_reads_cpu_chunks_a_pending_store_writes(bpc: int, groups: int) -> None:
    be, w, _ = rig(bpc, groups)
    w.submit_store(1, gspec([1, 2], groups), cspec(2, bpc, 0, groups))
    w.submit_load(2, cspec(2, bpc, 0, groups), gspec([10, 11], groups))   # RAW on the chunks
    found = races(be)
    assert found and "load job 2 reads host mapping" in found[0].detail and "store job 1" in found[0].detail
    assert "writes it" in found[0].detail
    w.shutdown()


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_store_writes_cpu_chunks_a_pending_load_reads(bpc: int, groups: int) -> None:
    be, w, _ = rig(bpc, groups)
    w.submit_store(1, gspec([1, 2], groups), cspec(2, bpc, 0, groups))
    w.wait({1})
    w.submit_load(2, cspec(2, bpc, 0, groups), gspec([10, 11], groups))
    w.submit_store(3, gspec([5, 6], groups), cspec(2, bpc, 0, groups))   # WAR on the chunks the load reads
    found = races(be)
    assert found and "store job 3 writes host mapping" in found[0].detail and "load job 2" in found[0].detail
    w.shutdown()


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_compute_writes_gpu_rows_a_pending_load_writes(bpc: int, groups: int) -> None:
    be, w, gpu = rig(bpc, groups)
    w.submit_store(1, gspec([1, 2], groups), cspec(2, bpc, 0, groups))
    w.wait({1})
    w.submit_load(2, cspec(2, bpc, 0, groups), gspec([7, 8], groups))
    be.enqueue_compute_write(gpu[0], [8], 1, delay=0.0)   # WAW: compute writes a row a pending load writes
    found = races(be)
    assert found and found[0].detail.startswith("compute work on stream 'compute' writes device array 0")
    assert "load job 2" in found[0].detail and found[0].tag == ("load", 2)
    w.shutdown()


@pytest.mark.rule("R20")
@SHAPES
def test_sim_race_compute_queued_after_submission_vs_pending_store(bpc: int, groups: int) -> None:
    be, w, gpu = rig(bpc, groups)
    w.submit_store(1, gspec([3], groups), cspec(1, bpc, 0, groups))
    be.enqueue_compute_write(gpu[1], [3], 5, delay=0.0)   # WAR: the store still reads row 3
    found = races(be)
    assert found and "compute" in found[0].detail and "store job 1" in found[0].detail and "reads it" in found[0].detail
    w.shutdown()


@pytest.mark.rule("R20")
def test_sim_race_compute_on_a_named_stream_is_not_ordered_by_the_default_one() -> None:
    be, w, gpu = rig(1)
    be.enqueue_compute_write(gpu[0], [4], 5, delay=1.0, stream="attention")   # the worker waits on "compute"
    w.submit_store(1, gspec([4]), cspec(1, 1, 0))   # RAW: reads row 4 that the named stream's kernel writes
    found = races(be)
    assert found and "store job 1 reads device array 0" in found[0].detail
    assert "compute work on stream 'compute:attention'" in found[0].detail
    w.shutdown()


@pytest.mark.rule("R20")
def test_sim_race_reads_of_the_same_bytes_are_no_race_and_the_check_can_be_off() -> None:
    be, w, _ = rig(2)
    w.submit_store(1, gspec([1, 2]), cspec(2, 2, 0))
    w.submit_store(2, gspec([1, 2]), cspec(2, 2, 4))   # same GPU rows read twice, other chunks
    w.wait({1, 2})
    assert races(be) == []
    w.shutdown()
    off, w2, _ = rig(1, race_check=False)
    w2.submit_store(1, gspec([1]), cspec(1, 1, 0))
    w2.submit_load(2, cspec(1, 1, 0), gspec([1]))
    w2.wait({1, 2})
    assert races(off) == []
    w2.shutdown()
    assert races(kv.get_backend("sim", race_check=False)) == []   # type: ignore[arg-type]


@pytest.mark.rule("R20")
def test_sim_race_memory_holds_only_ops_the_host_has_not_seen_complete() -> None:
    be, w, _ = rig(1)
    for job in range(50):
        w.submit_store(job, gspec([job % 8]), cspec(1, 1, job % 4))
        w.wait({job})
    assert be._race is not None and be._race.live_ops() <= 2
    w.shutdown()


# -- the detector against a naive pairwise model ----------------------------------------------------------------

_STREAMS = 3
_CELLS = 6   # bytes 0.._CELLS-1 of one device array, one byte per row


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Random sequences of device calls over a few streams and a few one-byte rows."""
    steps = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["copy", "copy", "compute", "record", "wait", "observe"]))
        stream = draw(st.integers(0, _STREAMS - 1))
        if kind == "copy":   # one or two descriptors, some empty (they touch nothing)
            descriptors = []
            for _ in range(draw(st.integers(1, 2))):
                src, dst = draw(st.integers(0, _CELLS - 1)), draw(st.integers(0, _CELLS - 1))
                width = draw(st.sampled_from([0, 1, 1, 2]))
                descriptors.append((min(src, _CELLS - width), min(dst, _CELLS - width), width))
            steps.append(("copy", stream, tuple(descriptors)))
        elif kind == "compute":
            steps.append(("compute", draw(st.integers(0, _CELLS - 1))))
        elif kind == "record":
            steps.append(("record", stream, draw(st.integers(0, 2))))
        elif kind == "wait":
            steps.append(("wait", stream, draw(st.integers(0, 2))))
        else:
            steps.append(("observe", draw(st.integers(0, 2)), draw(st.booleans())))
    return steps


def _run_detector(steps: list[tuple[Any, ...]]) -> set[tuple[int, int]]:
    be = SimBackend()
    dev = be.empty_device((_CELLS, 1))
    base = be.array_info(dev).ptr
    streams = [be.create_stream() for _ in range(_STREAMS)]
    events = [be.create_event() for _ in range(3)]
    for step in steps:
        if step[0] == "copy":
            _, s, descriptors = step
            buf = be.alloc_descriptors(len(descriptors))
            src, dst, width = (np.array(column) for column in zip(*descriptors, strict=True))
            buf.fill(base + src, base + dst, width)
            be.copy_batch(streams[s], buf, len(descriptors))
        elif step[0] == "compute":
            be.enqueue_compute_write(dev, [step[1]], 1, delay=0.0)
        elif step[0] == "record":
            be.record(events[step[2]], streams[step[1]])
        elif step[0] == "wait":
            be.wait_event(streams[step[1]], events[step[2]])
        else:
            _, e, blocking = step
            if blocking:
                be.synchronize(events[e])
            else:
                be.sleep(1.0)
                assert be.query(events[e])
    return {v.pair for v in be.violations if v.kind == "dma_race" and v.pair is not None}


def _run_model(steps: list[tuple[Any, ...]]) -> set[tuple[int, int]]:
    """Explicit happens-before graph over every op and record, closed transitively; then every pair checked."""
    ops: list[tuple[set[int], set[int]]] = []          # per op: (bytes read, bytes written)
    preds: list[set[int]] = []                          # per op: op indices before it (transitive)
    last_on: dict[int, set[int]] = {s: set() for s in range(_STREAMS + 1)}   # stream -> ops ordered before next
    recorded: dict[int, set[int]] = {}                  # event -> the ops its latest record follows
    host: set[int] = set()
    compute = _STREAMS
    for step in steps:
        if step[0] in ("copy", "compute"):
            stream = step[1] if step[0] == "copy" else compute
            if step[0] == "copy":
                access = (set().union(*(range(src, src + width) for src, _, width in step[2])),
                          set().union(*(range(dst, dst + width) for _, dst, width in step[2])))
            else:
                access = (set(), {step[1]})
            before = last_on[stream] | host
            preds.append(set(before))
            ops.append(access)
            last_on[stream] = before | {len(ops) - 1}
        elif step[0] == "record":
            recorded[step[2]] = set(last_on[step[1]] | host)
        elif step[0] == "wait":
            last_on[step[1]] = last_on[step[1]] | recorded.get(step[2], set())
        else:
            host |= recorded.get(step[1], set())
    found = set()
    for b, a in itertools.product(range(len(ops)), repeat=2):
        if a >= b or a in preds[b]:
            continue
        (ra, wa), (rb, wb) = ops[a], ops[b]
        if (wa & (rb | wb)) or (ra & wb):
            found.add((a, b))
    return found


@pytest.mark.rule("R20")
@settings(max_examples=150, deadline=None)
@given(schedules())
def test_sim_race_detector_matches_a_naive_pairwise_model(steps: list[tuple[Any, ...]]) -> None:
    assert _run_detector(steps) == _run_model(steps)


# -- held blocks at the backend level (R27): a late copy, then fresh-stream work on its rows ---------------------


class LateRig:
    """A sim (one device array, one pinned host buffer) whose job 1 copy is late: slow, or hung until ended (or,
    with ``"none"``, on time: no fault plan)."""

    def __init__(self, late: str) -> None:
        stall = (kv.Fault("copy", "slow", job_id=1, duration=5.0) if late == "slow"
                 else kv.Fault("copy", "hang", job_id=1))
        self.late = late
        self.be = SimBackend(kv.FaultPlan([stall]) if late != "none" else None)
        dev = self.be.empty_device((8, PAGE))
        assert isinstance(dev, np.ndarray)
        self.dev = dev
        self.host = np.zeros(8 * PAGE, dtype=np.uint8)
        self.be.track_host(self.host.ctypes.data, self.host.nbytes)
        self.be.host_register(self.host.ctypes.data, self.host.nbytes)

    def submit(self, job: int, direction: str, rows: Sequence[int], pages: Sequence[int]) -> tuple[Any, Any]:
        """A transfer as a worker queues one on a fresh stream: ordered after a marker recorded on the compute
        stream now (R4), then start record, copy, end record. Returns (stream, end event)."""
        be, tag = self.be, (direction, job)
        stream, marker = be.create_stream(), be.create_event()
        be.record(marker, be.current_stream())
        be.wait_event(stream, marker)
        start, end = be.create_event(tag=tag), be.create_event(tag=tag)
        be.record(start, stream, tag=tag)
        gpu = np.array([self.dev.ctypes.data + r * PAGE for r in rows], dtype=np.int64)
        cpu = np.array([self.host.ctypes.data + p * PAGE for p in pages], dtype=np.int64)
        buf = be.alloc_descriptors(len(rows), tag=tag)
        buf.fill(gpu, cpu, np.full(len(rows), PAGE, dtype=np.int64)) if direction == "store" else buf.fill(
            cpu, gpu, np.full(len(rows), PAGE, dtype=np.int64))
        be.copy_batch(stream, buf, len(rows), tag=tag)
        be.record(end, stream, tag=tag)
        return stream, end

    def let_it_land(self) -> None:
        """The late copy lands: the slow stall runs out, or the hang is ended and the copy runs."""
        if self.late == "hang":
            self.be.sleep(50.0)
            assert self.be.end_hangs(job_id=1) == 1
        self.be.sleep(10.0)


LATE = pytest.mark.parametrize("late", ["slow", "hang"])
# (the late job's direction, the later job's direction): the later one writes (or reads) rows the late one writes
CONFLICTS = pytest.mark.parametrize(("first", "then"), [("load", "load"), ("store", "store"), ("store", "load"),
                                                        ("load", "store")])


@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
@LATE
@CONFLICTS
def test_sim_race_late_copy_observed_done_orders_fresh_stream_work(late: str, first: str, then: str) -> None:
    rig = LateRig(late)
    _, end = rig.submit(1, first, [0, 1], [0, 1])
    rig.let_it_land()
    assert rig.be.query(end)                   # the hold ends: the host observed the late copy's end event
    _, later = rig.submit(2, then, [0, 1], [0, 1])
    rig.be.synchronize(later)
    assert races(rig.be) == []


@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
@LATE
@CONFLICTS
def test_sim_race_fresh_stream_work_before_the_late_copy_is_observed_is_flagged(late: str, first: str,
                                                                                   then: str) -> None:
    rig = LateRig(late)
    rig.submit(1, first, [0, 1], [0, 1])
    rig.be.sleep(1.0)                          # still pending (stalled), nothing observed
    _, later = rig.submit(2, then, [0, 1], [0, 1])
    found = races(rig.be)
    assert len(found) == 1 and f"{first} job 1" in found[0].detail and f"{then} job 2" in found[0].detail
    rig.let_it_land()
    rig.be.synchronize(later)
    assert len(races(rig.be)) == 1


@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
@LATE
def test_sim_race_late_copy_landed_but_not_observed_is_still_flagged(late: str) -> None:
    # by happens-before, not by timing: the copy has landed, but nobody looked, so nothing orders job 2 after it
    rig = LateRig(late)
    rig.submit(1, "load", [3], [0])
    rig.let_it_land()
    rig.submit(2, "load", [3], [1])
    assert len(races(rig.be)) == 1


@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
@LATE
@pytest.mark.parametrize("direction", ["load", "store"])
def test_sim_race_compute_write_to_rows_a_late_copy_touches_is_flagged(late: str, direction: str) -> None:
    rig = LateRig(late)
    _, end = rig.submit(1, direction, [2, 5], [0, 1])    # a load writes rows 2 and 5; a store reads them
    rig.be.enqueue_compute_write(rig.dev, [5], 9, 0.0)   # a caller writing a held block by other means
    found = races(rig.be)
    assert len(found) == 1 and f"{direction} job 1" in found[0].detail and "compute work" in found[0].detail
    rig.let_it_land()
    assert rig.be.query(end)
    rig.be.enqueue_compute_write(rig.dev, [5], 9, 0.0)   # once the hold ended: ordered, no new violation
    assert len(races(rig.be)) == 1


@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
def test_sim_race_a_batched_query_observes_every_stream_it_saw_done() -> None:
    # a poll over the end events of two streams (a retired one and a fresh one) observes both copies (a batched
    # query answers only without a fault plan)
    rig = LateRig("none")
    _, first = rig.submit(1, "load", [0], [0])
    _, second = rig.submit(2, "load", [1], [1])
    rig.let_it_land()
    assert rig.be.query_prefix([first, second]) == 2
    rig.be.enqueue_compute_write(rig.dev, [0, 1], 7, 0.0)
    assert races(rig.be) == []
