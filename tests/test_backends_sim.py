"""The simulated device: clock, lazy FIFO streams, events, memory by address, violations, ledger, scale."""

from __future__ import annotations

import dataclasses
import logging
import mmap
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvoffload_ref import backends
from kvoffload_ref.backends._simbatch import PREFIX_FIRST_RUN
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Ledger, Stream, Tag
from kvoffload_ref.backends.sim import SimBackend, SimHang
from kvoffload_ref.errors import DeviceError, InvalidTransferError, LifecycleError

PAGE = 4096
LATENCY = 5e-6
PINNED_BW = 25e9
PAGEABLE_BW = 8e9
TAG: Tag = ("store", 1)


@dataclasses.dataclass
class Rig:
    """A sim with one device array and one tracked host buffer (pinned unless asked otherwise)."""

    be: SimBackend
    dev: npt.NDArray[np.uint8]
    host: npt.NDArray[np.uint8]

    @property
    def host_ptr(self) -> int:
        return int(self.host.ctypes.data)

    def dev_addr(self, row: int) -> int:
        return int(self.dev.ctypes.data) + row * int(self.dev.shape[1])

    def host_addr(self, page: int) -> int:
        return self.host_ptr + page * PAGE

    def copy(self, stream: Stream, pairs: Sequence[tuple[int, int]], tag: Tag | None = TAG,
             size: int = PAGE) -> DescriptorBuffer:
        """Queue one copy of ``size`` bytes per (src address, dst address) pair."""
        buf = self.be.alloc_descriptors(len(pairs), tag=tag)
        src, dst = (np.array([p[i] for p in pairs], dtype=np.int64) for i in (0, 1))
        buf.fill(src, dst, np.full(len(pairs), size, dtype=np.int64))
        self.be.copy_batch(stream, buf, len(pairs), tag=tag)
        return buf

    def end_event(self, stream: Stream, tag: Tag | None = TAG) -> Event:
        event = self.be.create_event(tag=tag)
        self.be.record(event, stream, tag=tag)
        return event


def make_rig(*, pinned: bool = True, rows: int = 8, host_pages: int = 8, latency: float = LATENCY,
             pinned_bandwidth: float = PINNED_BW) -> Rig:
    be = SimBackend(latency=latency, pinned_bandwidth=pinned_bandwidth, pageable_bandwidth=PAGEABLE_BW)
    dev = be.empty_device((rows, PAGE))
    assert isinstance(dev, np.ndarray)
    dev[...] = np.arange(rows, dtype=np.uint8)[:, None] + 1      # row r holds byte r + 1
    host = np.zeros(host_pages * PAGE, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    if pinned:
        be.host_register(int(host.ctypes.data), host.nbytes)
    return Rig(be, dev, host)


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield make_rig()


def copy_time(nbytes: int, bandwidth: float = PINNED_BW) -> float:
    return LATENCY + nbytes / bandwidth


# -- protocol, clock, factory ----------------------------------------------------------------------------------


def test_sim_satisfies_the_backend_protocol() -> None:
    be = SimBackend()
    assert isinstance(be, Backend) and be.name == "sim"
    assert be.current_stream() is be.current_stream()
    assert be.ledger.live() == {}, "the compute stream is not the library's resource"


def test_sim_clock_starts_at_zero_and_only_sleep_advances_it(rig: Rig) -> None:
    be = rig.be
    assert be.monotonic() == 0.0
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    end = rig.end_event(stream)
    assert not be.query(end) and not be.query(end) and be.monotonic() == 0.0, "polling does not move time"
    be.sleep(0.25)
    be.clock_advance(0.25)
    assert be.monotonic() == 0.5 and be.query(end)
    with pytest.raises(ValueError, match="negative"):
        be.sleep(-1.0)


def test_sim_work_runs_lazily_and_takes_latency_plus_bytes_over_bandwidth(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(3), rig.host_addr(0)), (rig.dev_addr(4), rig.host_addr(1))])
    end = rig.end_event(stream)
    be.sleep(copy_time(2 * PAGE) * 0.99)
    assert not be.query(end) and not rig.host.any(), "nothing moves before the op's finish time"
    be.synchronize(end)
    assert be.monotonic() == pytest.approx(copy_time(2 * PAGE))
    assert (rig.host[:PAGE] == 4).all() and (rig.host[PAGE:2 * PAGE] == 5).all()


def test_sim_copies_from_unpinned_host_memory_are_legal_and_slower() -> None:
    rig = make_rig(pinned=False)
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    be.synchronize(rig.end_event(stream))
    assert be.monotonic() == pytest.approx(copy_time(PAGE, PAGEABLE_BW))
    assert (rig.host[:PAGE] == 1).all() and not be.violations


def test_get_backend_by_name() -> None:
    assert isinstance(backends.get_backend("sim"), SimBackend)
    slow = backends.get_backend("sim", latency=1.0)
    assert isinstance(slow, SimBackend)
    with pytest.raises(ValueError, match=r"'auto', 'sim', 'cupy'"):
        backends.get_backend("tpu")


def test_get_backend_auto_falls_back_to_the_sim_with_one_info_line(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    def missing() -> types.ModuleType:
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(backends, "_cupy_module", missing)
    with caplog.at_level(logging.INFO, logger="kvoffload_ref"):
        assert isinstance(backends.get_backend("auto"), SimBackend)
    assert [r.getMessage() for r in caplog.records] == [
        "CuPy backend not available (No module named 'cupy'); using the simulated device"]

    no_gpu = types.SimpleNamespace(gpu_usable=lambda: (False, "no CUDA driver"))
    monkeypatch.setattr(backends, "_cupy_module", lambda: no_gpu)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvoffload_ref"):
        assert isinstance(backends.get_backend(), SimBackend)
    assert [r.getMessage() for r in caplog.records] == ["No usable GPU (no CUDA driver); using the simulated device"]


# -- streams, events and ordering ------------------------------------------------------------------------------


def test_sim_stream_is_fifo(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(1), rig.host_addr(0))])
    first = rig.end_event(stream)
    rig.copy(stream, [(rig.dev_addr(2), rig.host_addr(0))])
    second = rig.end_event(stream)
    be.synchronize(second)
    assert be.elapsed(first, second) == pytest.approx(copy_time(PAGE)), "the second starts when the first ends"
    assert (rig.host[:PAGE] == 3).all(), "the later copy lands last"


def test_sim_cross_stream_wait_orders_work(rig: Rig) -> None:
    be = rig.be
    producer, consumer = be.create_stream(), be.create_stream()
    rig.copy(producer, [(rig.dev_addr(5), rig.host_addr(0))])        # host page 0 <- 6
    produced = rig.end_event(producer)
    be.wait_event(consumer, produced)
    rig.copy(consumer, [(rig.host_addr(0), rig.dev_addr(0))])        # dev row 0 <- host page 0
    consumed = rig.end_event(consumer)
    be.synchronize(consumed)
    assert (rig.dev[0] == 6).all(), "the consumer read what the producer wrote"
    assert be.elapsed(produced, consumed) == pytest.approx(copy_time(PAGE))


@pytest.mark.rule("R4")
@pytest.mark.parametrize("with_wait", [False, True])
def test_sim_copy_without_a_wait_on_the_compute_stream_reads_stale_data(rig: Rig, with_wait: bool) -> None:
    be = rig.be
    be.enqueue_compute_write(rig.dev, [2], value=0xAB, delay=1e-3)   # a kernel still writing row 2
    stream = be.create_stream()
    if with_wait:
        marker = be.create_event()
        be.record(marker, be.current_stream())
        be.wait_event(stream, marker)
    rig.copy(stream, [(rig.dev_addr(2), rig.host_addr(0))])
    be.synchronize(rig.end_event(stream))
    expected = 0xAB if with_wait else 3
    assert (rig.host[:PAGE] == expected).all()
    assert (be.to_host(rig.dev)[2] == 0xAB).all(), "the kernel's write landed either way"


def test_sim_ops_ready_at_the_same_time_run_latest_submitted_first() -> None:
    # latency 1 s and a huge bandwidth: every copy takes exactly 1.0 virtual seconds, so the two finish together.
    rig = make_rig(latency=1.0, pinned_bandwidth=1e30)
    be = rig.be
    first, second = be.create_stream(), be.create_stream()
    rig.copy(first, [(rig.dev_addr(1), rig.host_addr(0))])
    rig.copy(second, [(rig.dev_addr(2), rig.host_addr(0))])
    be.sleep(1.0)
    assert (rig.host[:PAGE] == 2).all(), "the earlier submission is applied last"

    be.enqueue_compute_write(rig.dev, [7], value=0xEE, delay=1.0)    # ends exactly when the copy below ends
    rig.copy(first, [(rig.dev_addr(7), rig.host_addr(1))])
    be.sleep(1.0)
    assert (rig.host[PAGE:2 * PAGE] == 8).all(), "a tie never hands the copy the kernel's output"


def test_sim_events_follow_cuda_semantics(rig: Rig) -> None:
    be = rig.be
    event = be.create_event()
    assert be.query(event), "a never-recorded event is complete"
    be.enqueue_compute_write(rig.dev, [0], value=9, delay=1.0)
    be.record(event, be.current_stream())                             # generation 1: done at t=1
    waiter = be.create_stream()
    be.wait_event(waiter, event)                                      # captures generation 1
    be.enqueue_compute_write(rig.dev, [0], value=10, delay=5.0)
    be.record(event, be.current_stream())                             # generation 2: done at t=6
    rig.copy(waiter, [(rig.dev_addr(0), rig.host_addr(0))])
    done = rig.end_event(waiter)
    be.sleep(2.0)
    assert be.query(done) and not be.query(event), "the wait was on the generation current when it was made"
    assert (rig.host[:PAGE] == 9).all()
    be.synchronize(event)
    assert be.monotonic() == pytest.approx(6.0)


def test_sim_destroying_a_stream_does_not_cancel_its_work(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(6), rig.host_addr(0))])
    end = rig.end_event(stream)
    be.destroy_stream(stream)
    be.synchronize(end)
    assert (rig.host[:PAGE] == 7).all()
    with pytest.raises(DeviceError) as info:
        be.record(end, stream)
    assert info.value.status == 400


def test_sim_to_host_waits_for_the_compute_stream(rig: Rig) -> None:
    rig.be.enqueue_compute_write(rig.dev, [1, 3], value=0x55, delay=2.0)
    snapshot = rig.be.to_host(rig.dev)
    assert rig.be.monotonic() == 2.0
    assert (snapshot[[1, 3]] == 0x55).all() and (snapshot[0] == 1).all()


def test_sim_elapsed_needs_completed_events(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    start = rig.end_event(stream)
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    end = rig.end_event(stream)
    with pytest.raises(DeviceError) as info:
        be.elapsed(start, end)
    assert info.value.status == 600
    be.synchronize(end)
    assert be.elapsed(start, end) == pytest.approx(copy_time(PAGE))


def test_sim_rejects_handles_it_did_not_make(rig: Rig) -> None:
    other = SimBackend()
    with pytest.raises(DeviceError) as info:
        rig.be.record(rig.be.create_event(), other.create_stream())
    assert info.value.status == 400
    with pytest.raises(DeviceError):
        rig.be.query(other.create_event())
    foreign = other.alloc_descriptors(1)
    with pytest.raises(DeviceError):
        rig.be.copy_batch(rig.be.create_stream(), foreign, 1)
    with pytest.raises(InvalidTransferError, match=r"count must be an int in \[0, 1\] .*, got 2 "):
        rig.be.copy_batch(rig.be.create_stream(), rig.be.alloc_descriptors(1), 2)


# -- memory ------------------------------------------------------------------------------------------------------


def test_sim_device_arrays_and_their_geometry() -> None:
    be = SimBackend()
    dev = be.empty_device((4, 512))
    assert isinstance(dev, np.ndarray) and dev.dtype == np.uint8 and dev.flags.c_contiguous and not dev.any()
    info = be.array_info(dev)
    assert (info.ptr, info.rows, info.row_bytes, info.row_stride) == (dev.ctypes.data, 4, 512, 512)
    padded = dev[1:3, :500]
    assert be.array_info(padded) == type(info)(int(dev.ctypes.data) + 512, 2, 500, 512)
    source = np.arange(12, dtype=np.uint8).reshape(3, 4)
    copy = be.from_host(source)
    np.testing.assert_array_equal(be.to_host(copy), source)


@pytest.mark.rule("R7")
@pytest.mark.parametrize("bad", [
    np.zeros((4, 512), dtype=np.uint8),                # a plain numpy array, not the sim's
    "not an array",
])
def test_sim_array_info_rejects_foreign_arrays(bad: object) -> None:
    with pytest.raises(InvalidTransferError, match="device array"):
        SimBackend().array_info(bad)


def test_sim_array_info_rejects_wrong_dtype_rank_and_other_sims() -> None:
    be = SimBackend()
    dev = be.empty_device((4, 512))
    assert isinstance(dev, np.ndarray)
    with pytest.raises(InvalidTransferError, match="2-D uint8"):
        be.array_info(dev.view(np.int32))
    with pytest.raises(InvalidTransferError, match="2-D uint8"):
        be.array_info(dev.reshape(-1))
    with pytest.raises(InvalidTransferError, match="not a device array of this backend"):
        SimBackend().array_info(dev)
    with pytest.raises(InvalidTransferError, match="shape"):
        be.empty_device((0, 512))


def reference_copy(memory: dict[int, npt.NDArray[np.uint8]], src: list[int], dst: list[int],
                   sizes: list[int]) -> None:
    """Read every source, then write every destination, by address."""
    def locate(addr: int, n: int) -> tuple[npt.NDArray[np.uint8], int]:
        base = next(b for b, a in memory.items() if b <= addr and addr + n <= b + a.size)
        return memory[base], addr - base

    reads = [locate(s, n)[0][locate(s, n)[1]:locate(s, n)[1] + n].copy() for s, n in zip(src, sizes, strict=True)]
    for d, n, data in zip(dst, sizes, reads, strict=True):
        array, offset = locate(d, n)
        array[offset:offset + n] = data


def descriptor_pattern(rng: np.random.Generator, kind: str, n: int, row: int, size: int,
                       rows: int) -> npt.NDArray[np.int64]:
    """Byte offsets of n rows: a contiguous run, random rows on a row grid, or arbitrary byte offsets."""
    if kind == "run":
        first = int(rng.integers(0, rows - n + 1))
        return (np.arange(first, first + n) * row).astype(np.int64)
    picked = rng.choice(rows, size=n, replace=False).astype(np.int64)
    if kind == "grid":
        return picked * row
    return picked * row + rng.integers(0, row - size + 1, size=n)   # "bytes": off the row grid


@pytest.mark.parametrize("size", [64, 4096, 40_000])
@pytest.mark.parametrize(("src_kind", "dst_kind"), [
    ("run", "grid"), ("grid", "run"), ("grid", "grid"), ("bytes", "bytes"), ("run", "run")])
@pytest.mark.parametrize("count", [3, 200])
def test_sim_copy_moves_exactly_the_described_bytes(size: int, src_kind: str, dst_kind: str, count: int) -> None:
    rng = np.random.default_rng(size * 7 + count)
    be = SimBackend()
    row = size + 64                                      # padded rows: offsets sit on a grid wider than a copy
    rows = count * 2
    dev = be.empty_device((rows, row))
    assert isinstance(dev, np.ndarray)
    dev[...] = rng.integers(0, 256, dev.shape, dtype=np.uint8)
    host = rng.integers(0, 256, rows * row, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    so = descriptor_pattern(rng, src_kind, count, row, size, rows) + int(dev.ctypes.data)
    do = descriptor_pattern(rng, dst_kind, count, row, size, rows) + int(host.ctypes.data)
    memory = {int(dev.ctypes.data): dev.reshape(-1).copy(), int(host.ctypes.data): host.copy()}
    reference_copy(memory, so.tolist(), do.tolist(), [size] * count)
    buf = be.alloc_descriptors(count)
    buf.fill(so, do, np.full(count, size, dtype=np.int64))
    stream, end = be.create_stream(), be.create_event()
    be.copy_batch(stream, buf, count)
    be.record(end, stream)
    be.synchronize(end)
    np.testing.assert_array_equal(host, memory[int(host.ctypes.data)])
    np.testing.assert_array_equal(dev.reshape(-1), memory[int(dev.ctypes.data)])
    assert not be.violations


@pytest.mark.parametrize("count", [2, 100])
def test_sim_copy_within_one_array_reads_all_sources_first(count: int) -> None:
    be = SimBackend()
    dev = be.empty_device((count + 1, 64))
    assert isinstance(dev, np.ndarray)
    dev[...] = np.arange(count + 1, dtype=np.uint8)[:, None]
    base = int(dev.ctypes.data)
    buf = be.alloc_descriptors(count)        # shift every row down by one: row k+1 <- row k
    buf.fill(base + np.arange(count) * 64, base + np.arange(1, count + 1) * 64, np.full(count, 64))
    stream, end = be.create_stream(), be.create_event()
    be.copy_batch(stream, buf, count)
    be.record(end, stream)
    be.synchronize(end)
    np.testing.assert_array_equal(dev[:, 0], [0, *range(count)])


@dataclasses.dataclass
class Scatter:
    """A random copy over several spans (for the copy engine's grouping): descriptors, and every span's bytes."""

    spans: list[npt.NDArray[np.uint8]]   # 1-D views of the device arrays and the host buffers, by span
    src: list[int]
    dst: list[int]
    sizes: list[int]


def _pattern(rng: np.random.Generator, kind: str, n: int, size: int, start: int, room: int) -> list[int]:
    """n offsets of ``size``-byte ranges inside [start, start + room), which is at least 2 * n * size bytes:
    one run of adjacent ranges, two runs with a gap (on the first one's grid or not), distinct rows of one grid
    (random phase), or disjoint ranges off any grid."""
    if kind == "run":
        first = start + int(rng.integers(0, room - n * size + 1))
        return [first + k * size for k in range(n)]
    if kind == "runs":
        half, gap = n // 2, int(rng.integers(1, n * size + 1))
        gap = gap // size * size if rng.random() < 0.5 else gap
        return [start + k * size for k in range(half)] + [start + gap + k * size for k in range(half, n)]
    if kind == "grid":
        phase = int(rng.integers(0, size))
        rows = rng.permutation((room - phase) // size)[:n]
        return [start + phase + int(r) * size for r in rows]
    slots = rng.permutation(room // (2 * size))[:n]   # "bytes": a slot of 2 * size each, entered anywhere
    return [start + int(s) * 2 * size + int(rng.integers(0, size + 1)) for s in slots]


def random_scatter(seed: int, order: str, one_way: bool) -> tuple[SimBackend, Scatter, list[int]]:
    """Blocks of descriptors, each with one source span, one destination span, one size and one pattern per
    side; destinations never overlap (sources may). ``order``: the blocks one after another, shuffled
    descriptor by descriptor, or one block cut in two around the others. ``one_way``: no span is both read and
    written (else some usually are: all reads are staged first). Zero-size descriptors are mixed in."""
    rng = np.random.default_rng(seed)
    be = SimBackend()
    devs = [be.empty_device((64, 4096 + 64 * k)) for k in range(3)]
    hosts = [np.zeros(300_000 + 4096 * k, dtype=np.uint8) for k in range(2)]
    for host in hosts:
        be.track_host(int(host.ctypes.data), host.nbytes)
    spans = [np.asarray(d).reshape(-1) for d in devs] + hosts
    for span in spans:
        span[...] = rng.integers(0, 256, span.size, dtype=np.uint8)
    cursor = [0] * len(spans)                    # destinations are carved from each span front to back
    readable = rng.permutation(len(spans))[:2].tolist() if one_way else list(range(len(spans)))
    writable = [k for k in range(len(spans)) if k not in readable] if one_way else list(range(len(spans)))
    blocks: list[list[tuple[int, int, int]]] = []
    for _ in range(int(rng.integers(2, 9))):
        size = int(rng.choice([64, 1000, 4096, 40_000]))
        a = int(rng.choice(readable))
        b = min(writable, key=lambda k: (cursor[k] - spans[k].size + rng.random() * 2e5))
        n = int(rng.integers(1, max(2, min(100, (spans[b].size - cursor[b]) // (2 * size)))))
        room = 2 * n * size
        if cursor[b] + room > spans[b].size or 2 * n * size > spans[a].size:
            continue
        dst = _pattern(rng, str(rng.choice(["run", "runs", "grid", "bytes"])), n, size, cursor[b], room)
        cursor[b] += room
        src_room = int(rng.integers(room, spans[a].size + 1))
        src = _pattern(rng, str(rng.choice(["run", "runs", "grid", "bytes"])), n, size,
                       int(rng.integers(0, spans[a].size - src_room + 1)), src_room)
        base_a, base_b = int(spans[a].ctypes.data), int(spans[b].ctypes.data)
        blocks.append([(base_a + s, base_b + d, size) for s, d in zip(src, dst, strict=True)])
    if order == "segments":
        flat = [d for block in blocks for d in block]
    elif order == "shuffled":
        flat = [d for block in blocks for d in block]
        flat = [flat[k] for k in rng.permutation(len(flat))]
    else:   # "split": the first block's two halves around the others
        half = len(blocks[0]) // 2
        flat = blocks[0][:half] + [d for block in blocks[1:] for d in block] + blocks[0][half:]
    for k in sorted(rng.integers(0, len(flat) + 1, size=3).tolist(), reverse=True):
        flat.insert(k, (8, 16, 0))               # empty: touches nothing, even outside every span
    return be, Scatter(spans, *(list(x) for x in zip(*flat, strict=True))), [int(s.ctypes.data) for s in spans]


@pytest.mark.parametrize("one_way", [True, False])
@pytest.mark.parametrize("order", ["segments", "shuffled", "split"])
@pytest.mark.parametrize("seed", range(12))
def test_sim_copy_over_many_spans_moves_exactly_the_described_bytes(seed: int, order: str, one_way: bool) -> None:
    be, sc, bases = random_scatter(seed, order, one_way)
    memory = {base: span.copy() for base, span in zip(bases, sc.spans, strict=True)}
    live = [k for k, n in enumerate(sc.sizes) if n]
    reference_copy(memory, [sc.src[k] for k in live], [sc.dst[k] for k in live], [sc.sizes[k] for k in live])
    count = len(sc.sizes)
    buf = be.alloc_descriptors(count)
    buf.fill(np.array(sc.src, dtype=np.int64), np.array(sc.dst, dtype=np.int64), np.array(sc.sizes, dtype=np.int64))
    stream, end = be.create_stream(), be.create_event()
    be.copy_batch(stream, buf, count)
    be.record(end, stream)
    be.synchronize(end)
    assert not be.violations
    for base, span in zip(bases, sc.spans, strict=True):
        np.testing.assert_array_equal(span, memory[base])


def test_sim_copy_of_many_tensors_in_one_batch_runs_each_way_as_planned() -> None:
    """The worker's shape: 32 layer tensors (32 spans) to one host buffer and back, group after group."""
    be, rng, page, rows = SimBackend(), np.random.default_rng(5), 4096, 64
    devs = [be.empty_device((2 * rows, page)) for _ in range(32)]
    for dev in devs:
        np.asarray(dev)[...] = rng.integers(0, 256, (2 * rows, page), dtype=np.uint8)
    host = np.zeros(32 * rows * page, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    picked = rng.permutation(2 * rows)
    out_rows, back_rows = picked[:rows], picked[rows:]
    gpu = np.concatenate([int(np.asarray(d).ctypes.data) + out_rows * page for d in devs])
    back = np.concatenate([int(np.asarray(d).ctypes.data) + back_rows * page for d in devs])
    cpu = int(host.ctypes.data) + np.arange(32 * rows, dtype=np.int64) * page
    stream, end = be.create_stream(), be.create_event()
    for src, dst in ((gpu, cpu), (cpu, back)):
        buf = be.alloc_descriptors(src.size)
        buf.fill(src, dst, np.full(src.size, page))
        be.copy_batch(stream, buf, src.size)
    be.record(end, stream)
    be.synchronize(end)
    for t, dev in enumerate(devs):
        array = np.asarray(dev)
        np.testing.assert_array_equal(host[t * rows * page:(t + 1) * rows * page].reshape(rows, page),
                                      array[out_rows])
        np.testing.assert_array_equal(array[back_rows], array[out_rows])
    assert not be.violations


# -- host registration -------------------------------------------------------------------------------------------


def test_sim_host_registration_errors() -> None:
    rig = make_rig(pinned=False)
    be, ptr = rig.be, rig.host_ptr
    with pytest.raises(DeviceError) as info:
        be.host_register(ptr + rig.host.nbytes - PAGE, 2 * PAGE)     # runs past the mapping
    assert info.value.status == 1
    be.host_register(ptr, 2 * PAGE)
    with pytest.raises(DeviceError) as info:
        be.host_register(ptr + PAGE, PAGE)
    assert info.value.status == 712
    with pytest.raises(DeviceError) as info:
        be.host_unregister(ptr + PAGE)
    assert info.value.status == 713 and not be.violations, "an unknown pointer is no double unregister"
    be.host_unregister(ptr)
    with pytest.raises(DeviceError) as info:
        be.host_unregister(ptr)
    assert info.value.status == 713
    assert [v.kind for v in be.violations] == ["double_unregister"]


# -- violations --------------------------------------------------------------------------------------------------


def assert_sticky_illegal_address(be: SimBackend, stream: Stream) -> None:
    """Every later device call raises 700; release calls still succeed."""
    calls: list[Callable[[], object]] = [be.create_stream, be.create_event, lambda: be.alloc_descriptors(1),
             lambda: be.record(be.create_event(), stream), lambda: be.empty_device((1, 1))]
    for call in calls:
        with pytest.raises(DeviceError) as info:
            call()
        assert info.value.status == 700
    be.destroy_stream(stream)


@pytest.mark.rule("R12")
def test_sim_untrack_under_a_pending_copy_is_a_violation_and_turns_sticky(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(2))])
    end = rig.end_event(stream)
    be.host_unregister(rig.host_ptr)
    kinds = [v.kind for v in be.violations]
    assert kinds == ["unregister_under_dma"] and be.violations[0].tag == TAG
    be.untrack_host(rig.host_ptr)
    assert [v.kind for v in be.violations] == ["unregister_under_dma", "unmap_under_dma"]
    be.sleep(1.0)
    assert be.violations[-1].kind == "illegal_address"
    assert not rig.host.any(), "the unmapped range was never touched"
    with pytest.raises(DeviceError) as info:
        be.query(end)
    assert info.value.status == 700
    assert_sticky_illegal_address(be, stream)


@pytest.mark.rule("R12")
def test_sim_unregister_under_a_pending_copy_is_a_violation(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.host_addr(1), rig.dev_addr(0))])
    end = rig.end_event(stream)
    be.host_unregister(rig.host_ptr)
    assert [v.kind for v in be.violations] == ["unregister_under_dma"]
    with pytest.raises(DeviceError) as info:
        be.synchronize(end)
    assert info.value.status == 700 and be.violations[-1].kind == "illegal_address"


def test_sim_release_after_the_copy_completed_is_clean(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    buf = rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    be.sleep(1.0)                      # done, though nobody queried an event
    be.free_descriptors(buf)
    be.host_unregister(rig.host_ptr)
    be.untrack_host(rig.host_ptr)
    assert not be.violations and (rig.host[:PAGE] == 1).all()


def test_sim_freeing_descriptors_under_a_pending_copy_is_a_violation(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    buf = rig.copy(stream, [(rig.dev_addr(4), rig.host_addr(0))])
    be.free_descriptors(buf)
    assert [v.kind for v in be.violations] == ["descriptor_freed_under_dma"]
    be.synchronize(rig.end_event(stream))
    assert (rig.host[:PAGE] == 5).all(), "the copy still ran with what it read"


def test_sim_copy_outside_every_live_span_is_an_illegal_address(rig: Rig) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0)), (rig.dev_addr(7), rig.host_addr(7) + 1)])
    end = rig.end_event(stream)
    with pytest.raises(DeviceError) as info:
        be.synchronize(end)
    assert info.value.status == 700
    assert [v.kind for v in be.violations] == ["illegal_address"] and "descriptor 1" in be.violations[0].detail
    assert not rig.host.any(), "a failing copy moves nothing"
    assert_sticky_illegal_address(be, stream)


def test_sim_nothing_runs_after_the_illegal_address_within_the_same_sleep(rig: Rig) -> None:
    """The copy that turns the device sticky halts it at once: work due later in the same clock step (a good copy
    on another stream) never runs (the scheduler asks whether the device halted only once it can be)."""
    be = rig.be
    bad, good = be.create_stream(), be.create_stream()
    rig.copy(bad, [(rig.dev_addr(7), rig.host_addr(7) + 1)])   # one byte past the host mapping
    buf = rig.copy(good, [(rig.dev_addr(0), rig.host_addr(0)), (rig.dev_addr(1), rig.host_addr(1))])   # later
    be.sleep(1.0)
    assert [v.kind for v in be.violations] == ["illegal_address"]
    assert not rig.host.any(), "the later copy never ran"
    with pytest.raises(DeviceError) as info:   # and no copy is accepted any more (no fault plan needed)
        be.copy_batch(good, buf, 1)
    assert info.value.status == 700


def test_sim_illegal_address_names_the_descriptor_as_read_when_the_copy_started(rig: Rig) -> None:
    """The violation names the bad descriptor's source and destination as the copy read them when it started,
    not what the buffer holds later (a small copy keeps its descriptors as Python ints and makes its arrays only
    when asked)."""
    be = rig.be
    stream = be.create_stream()
    src, dst = rig.dev_addr(1), rig.host_addr(7) + 1   # runs one byte past the host mapping
    buf = rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0)), (src, dst)])   # starts at once: the stream is idle
    buf.fill(np.full(2, rig.dev_addr(2), dtype=np.int64), np.full(2, rig.host_addr(2), dtype=np.int64),
             np.full(2, 8, dtype=np.int64))   # rewritten under the copy: it must not change what was read
    with pytest.raises(DeviceError):
        be.synchronize(rig.end_event(stream))
    assert [v.kind for v in be.violations] == ["illegal_address"]
    assert f"descriptor 1 (src {src:#x}, dst {dst:#x}, {PAGE} bytes)" in be.violations[0].detail


def test_sim_releasing_what_is_not_live_is_recorded_not_raised(rig: Rig) -> None:
    be = rig.be
    stream, event, buf = be.create_stream(), be.create_event(), be.alloc_descriptors(1)
    releases: list[Callable[[], None]] = [lambda: be.destroy_stream(stream), lambda: be.destroy_event(event),
                                          lambda: be.free_descriptors(buf)]
    for release in releases:
        release()
        release()
    be.untrack_host(rig.host_ptr + 1)
    assert [v.kind for v in be.violations] == ["invalid_release"] * 4



# -- batched calls -----------------------------------------------------------------------------------------------


@pytest.mark.rule("R10")
def test_sim_query_prefix_counts_the_completed_events_from_the_first(rig: Rig) -> None:
    be = rig.be
    fast, slow = be.create_stream(), be.create_stream()
    done = [rig.end_event(fast) for _ in range(2)]
    rig.copy(slow, [(rig.dev_addr(0), rig.host_addr(0))])
    pending = rig.end_event(slow)
    never = be.create_event()                          # never recorded: counts as complete, as in query()
    be.sleep(1.0)
    rig.copy(slow, [(rig.dev_addr(1), rig.host_addr(1))])
    later = rig.end_event(slow)                        # its copy has not run yet
    assert be.query_prefix([*done, never]) == 3
    assert be.query_prefix([*done, later, *done]) == 2, "stops at the first event not yet complete"
    assert be.query_prefix([pending, later]) == 1
    be.destroy_event(done[1])
    assert be.query_prefix(done) == 1, "stops before a handle that is not live"
    be.on_call = lambda point, tag: None
    assert be.query_prefix([done[0]]) == 0, "an on_call hook sends every query through query()"
    assert not be.violations


@pytest.mark.rule("R10")
def test_sim_query_prefix_of_one_event_answers_as_query(rig: Rig) -> None:
    """One event alone (a wait's own job at the head of its queue): counted exactly when ``query`` would say
    done -- pending is 0, never recorded is 1, destroyed is 0 -- and an observed one orders later work (the race
    detector sees the host observe it, as through ``query``)."""
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    end = rig.end_event(stream)
    assert be.query_prefix([end]) == 0 and not be.query(end), "its copy has not run"
    assert be.query_prefix([be.create_event()]) == 1, "never recorded: complete, as in query()"
    be.sleep(1.0)
    assert be.query_prefix([end]) == 1 and be.query(end)
    gone = rig.end_event(stream)
    be.destroy_event(gone)
    assert be.query_prefix([gone]) == 0, "not live: stop before it (query() would raise)"
    rig.copy(stream, [(rig.dev_addr(1), rig.host_addr(1))])   # reads device row 1
    last = rig.end_event(stream)
    be.sleep(1.0)
    assert be.query_prefix([last]) == 1
    be.enqueue_compute_write(rig.dev, [1], 7, 0.0)   # ordered after the observed copy: no race
    be.sleep(1.0)
    assert not be.violations


class _Watched(Sequence[Event]):
    """A sequence of events that notes how far into it a caller looked."""

    def __init__(self, events: list[Event]) -> None:
        self.events, self.seen = events, 0

    def __len__(self) -> int:
        return len(self.events)

    def __getitem__(self, where: Any) -> Any:
        last = where.indices(len(self.events))[1] if isinstance(where, slice) else where % len(self.events) + 1
        self.seen = max(self.seen, last)
        return self.events[where]


@pytest.mark.rule("R10")
def test_sim_query_prefix_stops_at_the_first_pending_event(rig: Rig) -> None:
    """Wherever the first pending event sits in a long run (at, before and after the bounds of the runs the sim
    looks at), the count is exact; and a pending head costs a look at a few events, not at the whole run (a drain
    polls a queue of thousands)."""
    be = rig.be
    stream = be.create_stream()
    done = [rig.end_event(stream) for _ in range(130)]
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    pending = [rig.end_event(stream) for _ in range(1000)]   # behind a copy that has not run
    for first in (0, 1, 15, 16, 17, 47, 48, 49, 111, 112, 113, 130):
        assert be.query_prefix([*done[:first], *pending[:3], *done]) == first
    assert be.query_prefix(done) == len(done)
    watched = _Watched([*done[:3], *pending])
    assert be.query_prefix(watched) == 3
    assert watched.seen <= 2 * PREFIX_FIRST_RUN, "looked far past the first pending event"
    assert not be.violations


def test_sim_batched_calls_are_an_optional_extension_with_per_call_fallbacks(rig: Rig) -> None:
    from kvoffload_ref.backends import batched

    be = rig.be
    assert isinstance(be, batched.BatchedBackend) and isinstance(be, Backend)
    assert be.hang_horizon == 3600.0

    class PerCall:  # the required protocol only: no batched method
        def __init__(self, inner: SimBackend) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name in ("destroy_events", "free_descriptors_many", "query_prefix"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    plain = PerCall(be)
    assert not hasattr(plain, "query_prefix")
    stream = be.create_stream()
    done = [rig.end_event(stream) for _ in range(2)]
    buf = rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    pending = rig.end_event(stream)
    assert batched.query_prefix(plain, [*done, pending]) == 2  # type: ignore[arg-type]
    assert batched.query_prefix(be, [*done, pending]) == 2
    be.synchronize(pending)
    batched.destroy_events(plain, [*done, pending])  # type: ignore[arg-type]
    batched.free_descriptors_many(plain, [buf, be.alloc_descriptors(1)])  # type: ignore[arg-type]
    assert "event" not in be.ledger.live() and "descriptor" not in be.ledger.live() and not be.violations


@pytest.mark.rule("R16")
def test_sim_batched_releases_check_each_handle_like_the_single_calls(rig: Rig) -> None:
    be = rig.be
    events = [be.create_event() for _ in range(3)]
    be.destroy_events([events[0], events[1], events[0], SimBackend().create_event()])
    assert [v.kind for v in be.violations] == ["invalid_release"] * 2, "named twice, and another device's event"
    assert be.ledger.live()["event"] == 1 and be.ledger.state_of("event", id(events[1])) == "released"
    stream = be.create_stream()
    busy = rig.copy(stream, [(rig.dev_addr(4), rig.host_addr(0))])
    idle = be.alloc_descriptors(1)
    be.free_descriptors_many([idle, busy, idle])
    assert [v.kind for v in be.violations[2:]] == ["invalid_release", "descriptor_freed_under_dma"]
    assert "descriptor" not in be.ledger.live()
    be.synchronize(rig.end_event(stream))
    assert (rig.host[:PAGE] == 5).all(), "the copy still ran with what it read"


@pytest.mark.rule("R16")
def test_sim_batched_releases_refuse_none_as_the_single_calls_do(rig: Rig) -> None:
    be = rig.be
    event, buf = be.create_event(), be.alloc_descriptors(1)
    for single, batched in ((be.destroy_event, be.destroy_events), (be.free_descriptors, be.free_descriptors_many)):
        single(None)  # type: ignore[arg-type]
        batched([None])  # type: ignore[list-item]
    assert [v.kind for v in be.violations] == ["invalid_release"] * 4, "None is never a live handle"
    assert be.ledger.state_of("event", id(event)) == "live" and be.ledger.state_of("descriptor", id(buf)) == "live"


# -- ledger ------------------------------------------------------------------------------------------------------


@pytest.mark.rule("R16")
def test_sim_ledger_balances(rig: Rig) -> None:
    be = rig.be
    assert be.ledger.live() == {"mapping": 1, "pinned": 1}
    stream, event, buf = be.create_stream(), be.create_event(), be.alloc_descriptors(2)
    assert be.ledger.live() == {"mapping": 1, "pinned": 1, "stream": 1, "event": 1, "descriptor": 1}
    assert be.ledger.state_of("stream", id(stream)) == "live"
    assert be.ledger.state_of("pinned", rig.host_ptr) == "live"
    with pytest.raises(DeviceError):
        be.host_register(rig.host_ptr, PAGE)              # already pinned: no acquisition
    be.destroy_stream(stream)
    be.destroy_event(event)
    be.free_descriptors(buf)
    be.host_unregister(rig.host_ptr)
    be.untrack_host(rig.host_ptr)
    assert be.ledger.live() == {}
    assert be.ledger.acquired() == be.ledger.released() == {
        "mapping": 1, "pinned": 1, "stream": 1, "event": 1, "descriptor": 1}


@pytest.mark.rule("R16")
def test_ledger_transitions_tallies_and_misuse() -> None:
    ledger = Ledger()
    ledger.acquire("mapping", 0x1000)
    ledger.acquire("event", 1)
    ledger.acquire("stream", 7)
    ledger.acquire("event", 2)
    with pytest.raises(LifecycleError, match=r"^ledger: event 1 acquired twice$"):
        ledger.acquire("event", 1)
    assert list(ledger.live().items()) == [("mapping", 1), ("event", 2), ("stream", 1)], "first-seen kind order"
    ledger.quarantine("event", 1)
    ledger.leak("stream", 7)
    with pytest.raises(LifecycleError, match=r"^ledger: event 1 acquired twice$"):
        ledger.acquire("event", 1)                      # quarantined counts as taken
    for misuse, message in ((lambda: ledger.leak("event", 1), "cannot mark event 1 leaked: it is quarantined"),
                            (lambda: ledger.release("stream", 7), "cannot mark stream 7 released: it is leaked"),
                            (lambda: ledger.release("event", 3), "cannot mark event 3 released: it is unknown"),
                            (lambda: ledger.quarantine("pinned", 9), "cannot mark pinned 9 quarantined: it is "
                                                                       "unknown")):
        with pytest.raises(LifecycleError, match=rf"^ledger: {message}$"):
            misuse()
    ledger.release("event", 1)                          # a quarantined resource may still be released
    ledger.release("event", 2)
    ledger.acquire("event", 2)                          # a released key may come back (addresses get reused)
    assert ledger.state_of("event", 1) == "released" and ledger.state_of("event", 5) is None
    assert (ledger.live(), ledger.quarantined(), ledger.leaked()) == ({"mapping": 1, "event": 1}, {}, {"stream": 1})
    assert ledger.acquired() == {"mapping": 1, "event": 3, "stream": 1} and ledger.released() == {"event": 2}
    assert list(ledger.keys("event")) == [2] and list(ledger.keys("event", "released")) == [1]
    for kind in ("mapping", "event", "stream"):       # the conservation law, per kind
        assert ledger.acquired().get(kind, 0) == sum(tally().get(kind, 0) for tally in (
            ledger.released, ledger.live, ledger.quarantined, ledger.leaked))



@pytest.mark.rule("R16")
def test_ledger_release_many_is_release_for_each_key() -> None:
    ledger = Ledger()
    for key in range(6):
        ledger.acquire("event", key)
    ledger.quarantine("event", 5)
    ledger.release_many("event", [0, 5])               # live and quarantined alike
    assert ledger.live() == {"event": 4} and ledger.quarantined() == {} and ledger.released() == {"event": 2}
    with pytest.raises(LifecycleError, match=r"^ledger: cannot mark event 1 released: it is released$"):
        ledger.release_many("event", [1, 2, 1, 3])     # named twice: the keys before the second 1 are released
    assert [ledger.state_of("event", k) for k in range(5)] == ["released", "released", "released", "live", "live"]
    with pytest.raises(LifecycleError, match=r"^ledger: cannot mark event 9 released: it is unknown$"):
        ledger.release_many("event", [3, 9, 4])
    assert ledger.state_of("event", 3) == "released" and ledger.state_of("event", 4) == "live"
    assert ledger.acquired() == {"event": 6} and ledger.released() == {"event": 5} and ledger.live() == {"event": 1}
    ledger.release_many("event", iter([4]))            # any iterable of keys
    assert ledger.live() == {} and ledger.released() == {"event": 6}


# -- scale and speed ---------------------------------------------------------------------------------------------


def test_sim_ten_thousand_chained_transfers_drain_in_virtual_time() -> None:
    """10,000 transfers, each on its own stream waiting for the previous one's end: one synchronize drains them
    all, and the clock reads exactly their copies' time. (How fast in real time is a bench figure, not a test's.)"""
    rig = make_rig(rows=16, host_pages=16)
    be, n = rig.be, 10_000
    previous: Event | None = None
    for job in range(n):
        tag = ("store", job)
        stream = be.create_stream(tag=tag)
        if previous is not None:
            be.wait_event(stream, previous)
        rig.copy(stream, [(rig.dev_addr(job % 16), rig.host_addr(job % 16))], tag=tag)
        previous = rig.end_event(stream, tag)
    assert previous is not None and not be.query(previous)
    be.synchronize(previous)
    assert be.monotonic() == pytest.approx(n * copy_time(PAGE))


@pytest.mark.parametrize("page", [4096, 65536])
def test_sim_data_path_moves_scattered_rows_both_ways(page: int) -> None:
    """A store of scattered device rows into contiguous host pages and a load back into other rows move every
    byte (the bench's ``datapath_*`` figures time this path; no test asserts a speed)."""
    be, rows = SimBackend(), (1 << 20) // page
    dev = be.empty_device((2 * rows, page))
    assert isinstance(dev, np.ndarray)
    dev[...] = np.random.default_rng(page).integers(0, 256, dev.shape, dtype=np.uint8)
    host = np.zeros(rows * page, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    be.host_register(int(host.ctypes.data), host.nbytes)
    order = np.random.default_rng(0).permutation(2 * rows)
    source, target = order[:rows], order[rows:]
    cpu = int(host.ctypes.data) + np.arange(rows, dtype=np.int64) * page
    store, load = be.alloc_descriptors(rows), be.alloc_descriptors(rows)
    store.fill(int(dev.ctypes.data) + source * page, cpu, np.full(rows, page))
    load.fill(cpu, int(dev.ctypes.data) + target * page, np.full(rows, page))
    stream, end = be.create_stream(), be.create_event()
    expected = dev[source].copy()
    for buf in (store, load):
        be.copy_batch(stream, buf, rows)
        be.record(end, stream)
        be.synchronize(end)
    assert np.array_equal(host.reshape(rows, page), expected)
    assert np.array_equal(dev[target], expected) and np.array_equal(dev[source], expected)
    assert be.violations == []


def test_sim_hang_is_not_an_exception() -> None:
    assert issubclass(SimHang, BaseException) and not issubclass(SimHang, Exception)


# -- R7: every number the sim takes is checked before any arithmetic -------------------------------------------

#: The bad numbers of R7's audit, for a finite real parameter.
BAD_REALS = [10**400, -10**400, float("nan"), float("inf"), float("-inf"), True, "1", None, -1]
BAD_REAL_IDS = ["10**400", "-10**400", "nan", "inf", "-inf", "True", "str", "None", "-1"]
#: ... and for an int parameter.
BAD_INTS = [10**400, -10**400, float("nan"), float("inf"), 1.5, True, "1", None, -1]
BAD_INT_IDS = ["10**400", "-10**400", "nan", "inf", "1.5", "True", "str", "None", "-1"]


def _state(be: SimBackend) -> tuple[object, ...]:
    """What a refused call must leave as it was: the clock, the ledger, the violations, pending work."""
    return (be.monotonic(), be.ledger.live(), len(be.violations), len(be._pending))


@pytest.mark.rule("R7")
@pytest.mark.parametrize("arg", ["latency", "pinned_bandwidth", "pageable_bandwidth", "hang_horizon"])
@pytest.mark.parametrize("value", BAD_REALS, ids=BAD_REAL_IDS)
def test_sim_constructor_refuses_bad_numbers_naming_the_argument(arg: str, value: object) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^{arg}\b"):
        SimBackend(**{arg: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match=rf"^{arg}\b"):
        backends.get_backend("sim", **{arg: value})


@pytest.mark.rule("R7")
@pytest.mark.parametrize("arg", ["pinned_bandwidth", "pageable_bandwidth", "hang_horizon"])
def test_sim_constructor_refuses_zero_rates_and_horizons_but_takes_a_zero_latency(arg: str) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^{arg} = 0 is zero"):
        SimBackend(**{arg: 0})  # type: ignore[arg-type]
    assert SimBackend(latency=0, hang_horizon=np.float32(2.0)).hang_horizon == 2.0  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match=r"^race_check must be a bool"):
        SimBackend(race_check=1)  # type: ignore[arg-type]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("call", ["sleep", "clock_advance"])
@pytest.mark.parametrize("value", BAD_REALS, ids=BAD_REAL_IDS)
def test_sim_sleep_refuses_bad_durations_and_leaves_the_clock(rig: Rig, call: str, value: object) -> None:
    be = rig.be
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), rig.host_addr(0))])
    be.sleep(1e-9)
    before = _state(be)
    with pytest.raises(InvalidTransferError, match=r"^seconds\b"):
        getattr(be, call)(value)
    assert _state(be) == before and not rig.host.any(), "nothing ran, the clock did not move"


@pytest.mark.rule("R7")
def test_sim_sleep_refuses_to_move_the_clock_past_the_largest_float() -> None:
    be = SimBackend()
    be.sleep(1.7e308)
    with pytest.raises(InvalidTransferError, match=r"would move the clock past the largest float"):
        be.sleep(1.7e308)
    assert be.monotonic() == 1.7e308
    be.sleep(1e-300)   # below the clock's resolution there: one step, never zero, never infinity
    assert be.monotonic() == np.nextafter(1.7e308, np.inf)


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("kwargs", "message"), [
    *[(dict(value=v), r"^enqueue_compute_write: value ") for v in [*BAD_INTS, 256]],
    *[(dict(delay=v), r"^enqueue_compute_write: delay ") for v in BAD_REALS],
    *[(dict(rows=v), r"^enqueue_compute_write: rows") for v in ([1.5], [True], [-1], [2**63], "1", [[0]])],
    (dict(rows=[8]), r"^enqueue_compute_write: rows must be in \[0, 8\) \(the array's rows\), got \[8\] "
                     r"\(e\.g\. \[0\]\)$"),
])
def test_sim_compute_write_refuses_bad_numbers_and_queues_nothing(rig: Rig, kwargs: dict[str, object],
                                                                 message: str) -> None:
    be = rig.be
    args: dict[str, object] = {"rows": [1], "value": 7, "delay": 1.0, **kwargs}
    before = _state(be)
    with pytest.raises(InvalidTransferError, match=message):
        be.enqueue_compute_write(rig.dev, args["rows"], args["value"], args["delay"])  # type: ignore[arg-type]
    assert _state(be) == before
    be.sleep(10.0)
    assert (rig.dev[1] == 2).all(), "no kernel was queued"


@pytest.mark.rule("R7")
def test_sim_compute_write_takes_a_scalar_row_and_numpy_numbers(rig: Rig) -> None:
    rig.be.enqueue_compute_write(rig.dev, np.int64(2), np.uint8(9), np.float32(0.5))  # type: ignore[arg-type]
    rig.be.sleep(1.0)
    assert (rig.dev[2] == 9).all() and (rig.dev[3] == 4).all()


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [*BAD_INTS, 2**63], ids=[*BAD_INT_IDS, "2**63"])
def test_sim_alloc_descriptors_refuses_bad_capacities_before_counting_a_fault(value: object) -> None:
    from kvoffload_ref.faults import Fault, FaultPlan

    plan = FaultPlan([Fault("descriptor_alloc", nth=1)])
    be = SimBackend(plan)
    with pytest.raises(InvalidTransferError, match=r"^descriptor capacity "):
        be.alloc_descriptors(value)  # type: ignore[arg-type]
    assert be.ledger.live() == {} and plan.fired == []
    with pytest.raises(DeviceError):   # the first valid call is still the first call at the point
        be.alloc_descriptors(1)


def test_sim_descriptor_buffers_are_zeroed_writeable_and_share_no_word() -> None:
    be = SimBackend()
    capacities = [0, 1, 2, 3, 42, 43, 100, *[2] * 200]   # small ones share blocks (43 and up: their own array)
    bufs = [be.alloc_descriptors(c) for c in capacities]
    for n, buf in enumerate(bufs):
        for k, row in enumerate((buf.src, buf.dst, buf.sizes)):
            assert row.dtype == np.int64 and row.shape == (buf.capacity,) and row.flags.c_contiguous
            assert row.flags.writeable and not row.any(), "zeroed when allocated"
            row[...] = 3 * n + k + 1
    be.free_descriptors_many(bufs[::2])
    fresh = [be.alloc_descriptors(2) for _ in range(100)]
    assert not any(row.any() for buf in fresh for row in (buf.src, buf.dst, buf.sizes)), "words never reused"
    for n, buf in enumerate(bufs):   # nothing written since overlapped another buffer's words
        for k, row in enumerate((buf.src, buf.dst, buf.sizes)):
            assert (row == 3 * n + k + 1).all()
    be.free_descriptors_many([*bufs[1::2], *fresh])
    assert be.ledger.live() == {} and not be.violations


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [1.5, float("nan"), True, "1", None, 10**400], ids=repr)
def test_sim_copy_batch_refuses_a_count_that_is_not_an_int(rig: Rig, value: object) -> None:
    be = rig.be
    stream = be.create_stream()
    buf = be.alloc_descriptors(1)
    before = _state(be)
    with pytest.raises(InvalidTransferError, match=r"^copy_batch: count "):
        be.copy_batch(stream, buf, value)  # type: ignore[arg-type]
    assert _state(be) == before
    with pytest.raises(InvalidTransferError, match=r"^copy_batch: count must be an int in \[0, 1\] \(the buffer's "
                                                   r"capacity\), got 2 \(e\.g\. 1\)$"):
        be.copy_batch(stream, buf, 2)


@pytest.mark.rule("R7")
@pytest.mark.parametrize("shape", [(1.5, 8), (8, True), ("8", 8), (8,), 8, (10**400, 1), (2**40, 2**40), (0, 8)],
                         ids=repr)
def test_sim_empty_device_refuses_a_bad_shape(shape: object) -> None:
    be = SimBackend()
    with pytest.raises(InvalidTransferError, match=r"^shape"):
        be.empty_device(shape)  # type: ignore[arg-type]
    assert be._device_arrays == []


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("ptr", "nbytes"), [(4096.0, 8), (4096, 8.0), (True, 8), (4096, 10**400), (2**63, 1),
                                             (2**63 - 8, 16)], ids=repr)
def test_sim_host_calls_refuse_addresses_and_sizes_that_are_not_int64_ints(ptr: object, nbytes: object) -> None:
    be = SimBackend()
    with pytest.raises(InvalidTransferError, match=r"^track_host"):
        be.track_host(ptr, nbytes)  # type: ignore[arg-type]
    if ptr != 2**63 - 8:   # host_register checks the types and the int64 range; the range itself is the device's
        with pytest.raises(InvalidTransferError, match=r"^host_register"):
            be.host_register(ptr, nbytes)  # type: ignore[arg-type]
    assert be.ledger.live() == {}


# -- R29: a page-granular unmap of part of a tracked mapping ----------------------------------------------------


def _page_aligned_mapping(be: SimBackend, pages: int = 8) -> tuple[mmap.mmap, npt.NDArray[np.uint8], int]:
    """A tracked (unpinned) page-aligned host mapping of ``pages`` pages: (mapping, its bytes, its address)."""
    mapping = mmap.mmap(-1, pages * PAGE)
    host = np.frombuffer(mapping, dtype=np.uint8)
    ptr = int(host.ctypes.data)
    be.track_host(ptr, host.nbytes)
    return mapping, host, ptr


@pytest.mark.rule("R29")
def test_sim_untrack_host_pages_forgets_a_piece_and_keeps_the_rest() -> None:
    rig = make_rig(pinned=False)
    be = rig.be
    _, host, ptr = _page_aligned_mapping(be)
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), ptr + PAGE)])  # pending, into page 1: the piece below is not touched
    be.untrack_host_pages(ptr + 4 * PAGE, 2 * PAGE)
    be.sleep(1.0)
    assert not be.violations and (host[PAGE:2 * PAGE] == 1).all(), "the rest stays live"
    assert be.ledger.live()["mapping"] == 2, "a mapping untracked in part stays one resource"
    be.untrack_host(ptr)  # what is left of it, both pieces
    be.untrack_host(rig.host_ptr)
    assert not be.violations and "mapping" not in be.ledger.live()
    rig.copy(stream, [(rig.dev_addr(1), ptr + 7 * PAGE)])  # the last piece is gone too
    be.sleep(1.0)
    assert [v.kind for v in be.violations] == ["illegal_address"] and not host[7 * PAGE:].any()


@pytest.mark.rule("R29")
def test_sim_a_copy_touching_an_untracked_piece_is_flagged() -> None:
    rig = make_rig(pinned=False)
    be = rig.be
    _, host, ptr = _page_aligned_mapping(be)
    stream = be.create_stream()
    rig.copy(stream, [(rig.dev_addr(0), ptr + 3 * PAGE)])  # pending, into the piece about to go
    be.untrack_host_pages(ptr + 2 * PAGE, 2 * PAGE)
    assert [v.kind for v in be.violations] == ["unmap_under_dma"]
    be.sleep(1.0)
    assert be.violations[-1].kind == "illegal_address" and not host.any(), "the piece was never touched"


@pytest.mark.rule("R29")
def test_sim_a_copy_submitted_into_an_untracked_piece_is_flagged() -> None:
    rig = make_rig(pinned=False)
    be = rig.be
    _, host, ptr = _page_aligned_mapping(be)
    be.untrack_host_pages(ptr, PAGE)
    rig.copy(be.create_stream(), [(rig.dev_addr(0), ptr)])
    be.sleep(1.0)
    assert [v.kind for v in be.violations] == ["illegal_address"] and not host.any()


@pytest.mark.rule("R29")
@pytest.mark.rule("R7")
def test_sim_untrack_host_pages_refuses_what_is_not_a_piece_of_one_mapping() -> None:
    be = SimBackend()
    _, _, ptr = _page_aligned_mapping(be)
    for bad in [(ptr + 1, PAGE), (ptr, PAGE + 1), (ptr, 0), (ptr, 1.0)]:
        with pytest.raises(InvalidTransferError):
            be.untrack_host_pages(*bad)  # type: ignore[arg-type]
    be.untrack_host_pages(ptr + 7 * PAGE, 2 * PAGE)  # runs past the mapping's end
    assert [v.kind for v in be.violations] == ["invalid_release"]
    be.untrack_host_pages(ptr, PAGE)
    be.untrack_host(ptr + PAGE)  # a piece's start is not a mapping's: recorded, nothing forgotten
    assert [v.kind for v in be.violations] == ["invalid_release"] * 2
    be.untrack_host(ptr)
    assert "mapping" not in be.ledger.live()


@pytest.mark.rule("R29")
@pytest.mark.rule("R12")
def test_sim_a_release_under_many_pending_copies_flags_exactly_those_touching_it() -> None:
    """Past a few pending copies the sim finds those a release touches in one vectorized pass: the same ones, in
    the same order, as copy by copy (sources and destinations both)."""
    rig = make_rig(pinned=False, rows=8)
    be = rig.be
    _, _, ptr = _page_aligned_mapping(be, pages=32)
    stream = be.create_stream()
    be.enqueue_compute_write(rig.dev, rows=[0], value=9, delay=1.0, stream=stream)  # holds the copies pending
    for i in range(30):  # copy i: device row -> host page i (odd i: the other way)
        pair = (rig.dev_addr(i % 8), ptr + i * PAGE) if i % 2 == 0 else (ptr + i * PAGE, rig.dev_addr(i % 8))
        rig.copy(stream, [pair], tag=("store", i))
    be.untrack_host_pages(ptr + 4 * PAGE, 3 * PAGE)  # pages 4, 5, 6: copies 4 (dst), 5 (src), 6 (dst)
    assert [(v.kind, v.tag) for v in be.violations] == [("unmap_under_dma", ("store", i)) for i in (4, 5, 6)]
