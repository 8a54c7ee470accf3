"""The sim's copy engine (``backends/_simmem.py``, ``backends/_simcopy.py``): span lookup, the slow (unpinned)
bytes a copy is priced by, and every row-copy path (slice, gather from a grid, whole-row scatter onto a grid, runs,
windows, loops) against a descriptor-by-descriptor reference, destinations that repeat or overlap included."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import pytest

from kvoffload_ref.backends import _simcopy, _simsized
from kvoffload_ref.backends._simcopy import _MAX_GRIDS
from kvoffload_ref.backends._simmem import EACH_MAX_PER_PAIR, SMALL_BATCH, CopyPlan, Intervals, SizedPlan
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import DeviceError

I64 = npt.NDArray[np.int64]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# -- span lookup -------------------------------------------------------------------------------------------------


def find_reference(ranges: list[tuple[int, int]], addr: list[int], size: list[int]) -> list[int]:
    """Index (in sorted order) of the range holding [a, a+n) whole, in Python ints (no overflow); the one that
    starts last when two do (an empty range at a shared bound)."""
    ordered = sorted(ranges)
    found = []
    for a, n in zip(addr, size, strict=True):
        hits = [k for k, (lo, hi) in enumerate(ordered) if lo <= a and n >= 0 and a + n <= hi]
        found.append(hits[-1] if hits else -1)
    return found


@pytest.mark.parametrize("seed", range(8))
def test_intervals_find_matches_a_scalar_reference_at_every_edge(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bounds = np.sort(rng.choice(np.arange(1, 10_000), size=12, replace=False)).tolist()
    ranges = [(bounds[k], bounds[k + 1]) for k in range(0, 12, 2)]
    ranges.append((bounds[-1], bounds[-1] + 50))   # adjacent to the last one
    edges = [x + d for lo, hi in ranges for x in (lo, hi) for d in (-1, 0, 1)]
    addr = edges + rng.integers(-100, 10_200, size=60).tolist() + [INT64_MIN, INT64_MAX, -1, 0]
    size = rng.choice([0, 1, 2, 49, 50, 51, 500, -1, INT64_MAX, INT64_MIN], size=len(addr)).tolist()
    expected = find_reference(ranges, addr, size)
    intervals = Intervals(ranges)
    assert len(addr) > SMALL_BATCH   # the vectorized lookup
    assert intervals.find(np.array(addr, dtype=np.int64), np.array(size, dtype=np.int64)).tolist() == expected
    for k in range(0, len(addr), SMALL_BATCH):   # and the scalar one, batch by batch
        part = slice(k, k + SMALL_BATCH)
        got = intervals.find(np.array(addr[part], dtype=np.int64), np.array(size[part], dtype=np.int64))
        assert got.tolist() == expected[part]
    empty = Intervals([]).find(np.array(addr, dtype=np.int64), np.array(size, dtype=np.int64))
    assert (empty == -1).all()
    moves, live_bytes, first_bad = intervals.moves(addr, addr[::-1], size)   # the per-descriptor path's lookup
    firsts, si, di = sorted(lo for lo, _ in ranges), [m[0] for m in moves], [m[1] for m in moves]
    assert si == expected
    assert di == find_reference(ranges, addr[::-1], size)
    assert live_bytes == sum(n for n in size if n > 0)
    bad = [k for k, (i, j) in enumerate(zip(si, di, strict=True)) if size[k] and min(i, j) < 0]
    assert first_bad == (bad[0] if bad else None)
    assert all(m[3] == (a - firsts[m[0]] if m[0] >= 0 else -1) for m, a in zip(moves, addr, strict=True))
    assert all(m[4] == (a - firsts[m[1]] if m[1] >= 0 else -1) for m, a in zip(moves, addr[::-1], strict=True))
    assert [m[0] for m in Intervals([]).moves(addr, addr, size)[0]] == [-1] * len(addr)


@pytest.mark.parametrize("seed", range(6))
def test_sim_sized_plans_resolve_as_the_vectorized_lookup_at_every_edge(seed: int) -> None:
    """A copy of more than SMALL_BATCH descriptors of one size, few per span pair, is resolved in one pass over
    both sides (a ``SizedPlan``) only when every side lies inside a span: then it reads what the general plan
    reads (a snapshot of the descriptors, each side's span, its live bytes, no bad descriptor). One side outside
    -- before every span, at a negative or extreme address, in a gap, one byte past a span's end -- and the copy
    is the general plan, which names the first bad descriptor."""
    rng = np.random.default_rng(300 + seed)
    be, size = SimBackend(), 256
    spans = random_spans(be, rng, [(4, 512), (2, 1024), (3, 256)], [4096])
    count = int(rng.integers(SMALL_BATCH + 1, 40))
    bounds = [(int(s.ctypes.data), int(s.ctypes.data) + s.size) for s in spans]
    edges = [a for lo, hi in bounds for a in (lo, lo + 1, hi - size)]   # first and last ranges a span holds
    src = [int(rng.choice(edges)) for _ in range(count)]
    dst = [int(rng.choice(edges)) for _ in range(count)]
    lowest, highest = min(lo for lo, _ in bounds), max(hi for _, hi in bounds)
    outside = [lowest - 1, lowest - size, 0, -1, -size, INT64_MIN, INT64_MIN + 1, INT64_MAX - size + 1,
               highest - size + 1, *(hi - size + 1 for _, hi in bounds)]
    cases: list[tuple[list[int], list[int]]] = [(src, dst)]
    for bad in outside:
        k, column = int(rng.integers(0, count)), int(rng.integers(0, 2))
        changed = [list(src), list(dst)]
        changed[column][k] = bad
        cases.append((changed[0], changed[1]))
    sizes, host = [size] * count, sorted(bounds).index(bounds[-1])
    for case_src, case_dst in cases:
        arrays = [np.array(v, dtype=np.int64) for v in (case_src, case_dst, sizes)]
        plan, slow = be._memory.plan(*arrays)
        si, di = find_reference(bounds, case_src, sizes), find_reference(bounds, case_dst, sizes)
        bad = [k for k in range(count) if min(si[k], di[k]) < 0]
        assert isinstance(plan, SizedPlan) == (not bad)
        assert isinstance(plan, CopyPlan) == bool(bad)
        for array in arrays:
            array[...] = 1   # the plan keeps what it read
        assert (plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()) == (case_src, case_dst, sizes)
        assert (plan.si.tolist(), plan.di.tolist()) == (si, di)
        assert plan.first_bad() == (bad[0] if bad else None)
        assert plan.live_bytes() == size * count
        assert slow == size * (si + di).count(host)   # the host span is tracked, never pinned
    pairs = sorted((bounds[k % 2][0] + size * (k // 2 % 4), bounds[-1][0] + size * (k % 16)) for k in range(count))
    half = count // 4
    for order in (pairs, pairs[half:] + pairs[:half]):   # many per span pair, in group order or not: grouped
        arrays = [np.array(v, dtype=np.int64) for v in ([p[0] for p in order], [p[1] for p in order], sizes)]
        grouped = be._memory.plan(*arrays)[0]
        assert isinstance(grouped, CopyPlan) and grouped.first_bad() is None


# -- slow bytes --------------------------------------------------------------------------------------------------

PINNED_BW, PAGEABLE_BW, PAGE = 1e9, 1e8, 4096


def timed_copy(be: SimBackend, src: list[int], dst: list[int], sizes: list[int]) -> float:
    """Run one copy to completion; the virtual seconds it took."""
    buf = be.alloc_descriptors(len(src))
    buf.fill(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(sizes, dtype=np.int64))
    stream, end = be.create_stream(), be.create_event()
    started = be.monotonic()
    be.copy_batch(stream, buf, len(src))
    be.record(end, stream)
    be.synchronize(end)
    return be.monotonic() - started


@pytest.mark.parametrize("count", [SMALL_BATCH, SMALL_BATCH + 4])
@pytest.mark.parametrize("bad_size", [-1, -PAGE])
def test_sim_copy_with_a_negative_size_is_an_illegal_address_at_every_batch_size(count: int, bad_size: int) -> None:
    """A descriptor of negative size lies in no span, small batch or large: the copy stops at execution with the
    illegal-address error (700) naming it and moves nothing (a large batch's span lookup leaves out the sign test
    only when its smallest size shows that no size is negative)."""
    be = SimBackend()
    source, target = (np.asarray(be.empty_device((count, PAGE))) for _ in range(2))
    source[:] = 9
    src = [int(source[k].ctypes.data) for k in range(count)]
    dst = [int(target[k].ctypes.data) for k in range(count)]
    sizes = [PAGE] * count
    sizes[count - 2] = bad_size   # it ends before it starts: any room "fits" it, only the sign test refuses it
    with pytest.raises(DeviceError) as info:
        timed_copy(be, src, dst, sizes)
    assert info.value.status == 700
    assert [v.kind for v in be.violations] == ["illegal_address"]
    assert f"descriptor {count - 2} " in be.violations[0].detail
    assert not target.any(), "a failing copy moves nothing"


def test_sim_prices_the_unpinned_host_bytes_of_large_batches_as_each_descriptor_lies() -> None:
    """Hosts fully pinned, half pinned and unpinned; descriptors inside, outside and across a pin's edge, on
    either side; the price follows every register and unregister."""
    be = SimBackend(latency=0.0, pinned_bandwidth=PINNED_BW, pageable_bandwidth=PAGEABLE_BW)
    dev = np.asarray(be.empty_device((64, PAGE)))
    hosts = [np.zeros(64 * PAGE, dtype=np.uint8) for _ in range(3)]
    ptrs = [int(h.ctypes.data) for h in hosts]
    for ptr, host in zip(ptrs, hosts, strict=True):
        be.track_host(ptr, host.nbytes)
    pins: dict[int, int] = {}

    def pin(ptr: int, nbytes: int) -> None:
        be.host_register(ptr, nbytes)
        pins[ptr] = ptr + nbytes

    def unpin(ptr: int) -> None:
        be.host_unregister(ptr)
        del pins[ptr]

    pin(ptrs[0], 64 * PAGE)
    pin(ptrs[1], 32 * PAGE)
    rng = np.random.default_rng(3)
    base = int(dev.ctypes.data)
    src: list[int] = []
    dst: list[int] = []
    sizes: list[int] = []
    for k in range(40):
        mapping, offset = ptrs[k % 3], int(rng.integers(0, 63 * PAGE))
        if k % 7 == 0:
            mapping, offset = ptrs[1], 32 * PAGE - 100   # across the half pin's edge
        n = int(rng.integers(1, PAGE))
        there, here = mapping + offset, base + int(rng.integers(0, 63)) * PAGE
        pair = [(here, there), (there, here), (there, ptrs[(k + 1) % 3] + 8 * PAGE)][k % 3]
        src.append(pair[0])
        dst.append(pair[1])
        sizes.append(n)
    src.append(base)
    dst.append(ptrs[2])
    sizes.append(0)   # empty: never slow

    def expected() -> float:
        def slow(addr: int, n: int) -> int:
            on_host = any(p <= addr < p + 64 * PAGE for p in ptrs)
            held = any(a <= addr and addr + n <= b for a, b in pins.items())
            return n if on_host and n > 0 and not held else 0
        slow_bytes = sum(slow(s, n) + slow(d, n) for s, d, n in zip(src, dst, sizes, strict=True))
        return (sum(sizes) - slow_bytes) / PINNED_BW + slow_bytes / PAGEABLE_BW

    assert timed_copy(be, src, dst, sizes) == pytest.approx(expected(), rel=1e-12)
    unpin(ptrs[1])
    pin(ptrs[1], 64 * PAGE)   # now whole
    assert timed_copy(be, src, dst, sizes) == pytest.approx(expected(), rel=1e-12)
    pin(ptrs[2], 16 * PAGE)
    unpin(ptrs[0])
    assert timed_copy(be, src, dst, sizes) == pytest.approx(expected(), rel=1e-12)
    assert not [v for v in be.violations if v.kind != "crosses_registration"]


@pytest.mark.parametrize("sizes", [[PAGE] * 20, [PAGE] * 19 + [100], [0] + [PAGE] * 19, [100] + [PAGE] * 19])
def test_sim_prices_every_live_byte_of_a_large_batch(sizes: list[int]) -> None:
    """A copy of more than SMALL_BATCH descriptors takes latency + its live bytes / bandwidth: of one size (its
    bytes counted as size x count), of mixed sizes, with an empty descriptor (never counted)."""
    assert len(sizes) > SMALL_BATCH
    be = SimBackend(latency=1e-6, pinned_bandwidth=PINNED_BW, pageable_bandwidth=PAGEABLE_BW)
    dev = np.asarray(be.empty_device((len(sizes), PAGE)))
    host = np.zeros(len(sizes) * PAGE, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    be.host_register(int(host.ctypes.data), host.nbytes)
    rows = [int(dev.ctypes.data) + k * PAGE for k in range(len(sizes))]
    chunks = [int(host.ctypes.data) + k * PAGE for k in range(len(sizes))]
    assert timed_copy(be, rows, chunks, sizes) == pytest.approx(1e-6 + sum(sizes) / PINNED_BW, rel=1e-12)
    assert not be.violations


# -- row-copy paths ----------------------------------------------------------------------------------------------


def offsets(rng: np.random.Generator, kind: str, n: int, size: int, room: int) -> list[int]:
    """n offsets of ``size``-byte ranges in [0, room): one run, long runs with gaps, rows of one grid (random
    phase, rows may repeat), or anywhere (ranges may overlap)."""
    if kind == "run":
        first = int(rng.integers(0, room - n * size + 1))
        return [first + k * size for k in range(n)]
    if kind == "runs":   # runs of >= 32 rows on one grid or off it
        cuts = sorted(rng.choice(np.arange(32, n - 31), size=1).tolist()) if n >= 64 else []
        out, at = [], int(rng.integers(0, size))
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            start = at if rng.random() < 0.5 else at // size * size
            out += [start + k * size for k in range(b - a)]
            at = (start + (b - a) * size + int(rng.integers(0, 3 * size))) % max(1, room - n * size)
        return [min(o, room - size) for o in out]
    if kind == "grid":   # rows drawn from about n / 2 of them: repeats (a later one wins)
        phase = int(rng.integers(0, size))
        count = (room - phase) // size
        first = int(rng.integers(0, count - min(count, max(2, n // 2)) + 1))
        rows = first + rng.integers(0, min(count, max(2, n // 2)), size=n)
        return [phase + int(r) * size for r in rows]
    return [int(o) for o in rng.integers(0, room - size + 1, size=n)]


def reference_copy(memory: dict[int, npt.NDArray[np.uint8]], src: list[int], dst: list[int],
                   sizes: list[int]) -> None:
    """The engine's meaning, on ``memory`` (span base address -> its bytes): every source read first; then the
    non-empty descriptors written group by group in key order (source span, destination span, size; spans by
    address), in descriptor order within a group (a later one wins)."""
    bases = sorted(memory)

    def locate(addr: int) -> int:
        return max(k for k, b in enumerate(bases) if b <= addr)

    def view(addr: int, n: int) -> npt.NDArray[np.uint8]:
        base = bases[locate(addr)]
        return memory[base][addr - base:addr - base + n]

    live = [k for k, n in enumerate(sizes) if n > 0]
    reads = {k: view(src[k], sizes[k]).copy() for k in live}
    for k in sorted(live, key=lambda k: (locate(src[k]), locate(dst[k]), sizes[k])):
        view(dst[k], sizes[k])[...] = reads[k]


KINDS = ["run", "runs", "grid", "bytes"]


def random_spans(be: SimBackend, rng: np.random.Generator, devices: list[tuple[int, int]],
                 hosts: list[int]) -> list[npt.NDArray[np.uint8]]:
    """Flat byte views of new device arrays (shapes ``devices``) then of tracked host arrays (sizes ``hosts``), all
    filled with random bytes: the spans a test's copies address."""
    spans = [np.asarray(be.empty_device(shape)).reshape(-1) for shape in devices]
    for size in hosts:
        host = np.zeros(size, dtype=np.uint8)
        be.track_host(int(host.ctypes.data), host.nbytes)
        spans.append(host)
    for span in spans:
        span[...] = rng.integers(0, 256, span.size, dtype=np.uint8)
    return spans


@pytest.mark.parametrize("seed", range(40))
def test_sim_copy_paths_match_the_descriptor_reference_with_repeated_destinations(seed: int) -> None:
    """Random batches of groups (any source and destination pattern, sizes on and off powers of two, large rows),
    destinations repeating within and across groups, groups in pieces or shuffled, some spans read and written:
    whatever path each group takes, the bytes are the reference's."""
    rng = np.random.default_rng(seed)
    be = SimBackend()
    spans = random_spans(be, rng, [(48, 4096 + 64 * k) for k in range(2)], [400_000 + 4096 * k for k in range(2)])
    one_way = seed % 3 != 0
    readable = [0, 2] if one_way else [0, 1, 2, 3]
    writable = [1, 3] if one_way else [0, 1, 2, 3]
    blocks: list[list[tuple[int, int, int]]] = []
    pairs = [(f, t) for f in KINDS for t in KINDS]
    for g in range(int(rng.integers(1, 6))):
        src_kind, dst_kind = pairs[(seed + 7 * g) % len(pairs)]   # every pair of patterns, seed after seed
        size = int(rng.choice([64, 100, 4096, 40_000]))
        a, b = int(rng.choice(readable)), int(rng.choice(writable))
        least = 64 if "runs" in (src_kind, dst_kind) else SMALL_BATCH + 1   # two runs of >= 32 rows
        n = int(rng.integers(least, 120)) if size < 40_000 else int(rng.integers(2, 8))
        room_a, room_b = spans[a].size, spans[b].size
        if n * size > min(room_a, room_b):
            n = min(room_a, room_b) // size
        so, do = offsets(rng, src_kind, n, size, room_a), offsets(rng, dst_kind, n, size, room_b)
        pa, pb = int(spans[a].ctypes.data), int(spans[b].ctypes.data)
        blocks.append([(pa + s, pb + d, size) for s, d in zip(so, do, strict=True)])
    flat = [d for block in blocks for d in block]
    order = seed % 4
    if order == 1:
        flat = [flat[k] for k in rng.permutation(len(flat))]
    elif order == 2 and len(blocks) > 1:   # the first group in two pieces around the others
        half = len(blocks[0]) // 2
        flat = blocks[0][:half] + [d for block in blocks[1:] for d in block] + blocks[0][half:]
    if order == 3:
        flat.insert(int(rng.integers(0, len(flat) + 1)), (8, 16, 0))   # empty, outside every span
    src, dst, sizes = ([int(x) for x in column] for column in zip(*flat, strict=True))
    expected = {int(span.ctypes.data): span.copy() for span in spans}
    reference_copy(expected, src, dst, sizes)
    timed_copy(be, src, dst, sizes)
    assert not be.violations
    for span in spans:
        np.testing.assert_array_equal(span, expected[int(span.ctypes.data)])


def test_sim_grid_views_stay_bounded_and_are_dropped_with_the_span_index() -> None:
    """The engine caches a view per (span, first byte, row size) it copies rows on: at most _MAX_GRIDS of them,
    and none once the spans change."""
    rng = np.random.default_rng(11)
    be = SimBackend()
    dev = np.asarray(be.empty_device((64, 4096))).reshape(-1)
    dev[...] = rng.integers(0, 256, dev.size, dtype=np.uint8)
    host = np.zeros(dev.size, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    base, hbase = int(dev.ctypes.data), int(host.ctypes.data)
    for size in range(1, _MAX_GRIDS + 40):   # one new grid per row size (random rows, gathered to one run)
        n = SMALL_BATCH + 1
        rows = rng.choice(dev.size // size, size=n, replace=False)
        timed_copy(be, (base + rows * size).tolist(), [hbase + k * size for k in range(n)], [size] * n)
        np.testing.assert_array_equal(host[:n * size].reshape(n, size),
                                      dev[:dev.size // size * size].reshape(-1, size)[rows])
    grids = be._memory._index().grids
    assert 0 < len(grids) <= _MAX_GRIDS
    be.empty_device((1, 64))
    assert be._memory._index().grids is not grids and not be._memory._index().grids


@pytest.mark.parametrize("one_size", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_sim_copies_of_few_descriptors_per_span_pair_go_descriptor_by_descriptor_in_group_order(
        seed: int, one_size: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's one-block job over many layers is one descriptor per (tensor, region) pair: such copies (and
    every copy of at most SMALL_BATCH descriptors) move descriptor by descriptor, never through the grouped path,
    yet write in its order -- by (source span, destination span, size), descriptor order within -- so where
    destinations of different pairs overlap, the bytes are still the reference's. Empty descriptors outside
    every span, spans read and written, sizes mixed; or (``one_size``) more than SMALL_BATCH descriptors of one
    size, out of group order, which are a ``SizedPlan`` and move by their offsets alone (``move_sized``)."""
    rng = np.random.default_rng(100 + seed)
    be = SimBackend()
    spans = random_spans(be, rng, [(8, 256 + 64 * k) for k in range(6)], [8192 + 512 * k for k in range(3)])
    one_way = seed % 2 == 0
    readable = list(range(6)) if one_way else list(range(len(spans)))
    writable = [6, 7, 8] if one_way else list(range(len(spans)))
    count = int(rng.choice([int(rng.integers(2, SMALL_BATCH + 1)), int(rng.integers(SMALL_BATCH + 1, 80))]))
    if one_size:
        count = int(rng.integers(SMALL_BATCH + 1, 80))
    flat = []
    for _ in range(count):
        a, b = int(rng.choice(readable)), int(rng.choice(writable))
        size = 100 if one_size else int(rng.choice([64, 100, 256]))
        s = int(rng.integers(0, spans[a].size - size + 1))
        d = int(rng.integers(0, 3)) * 64 if rng.random() < 0.5 else int(rng.integers(0, spans[b].size - size + 1))
        flat.append((int(spans[a].ctypes.data) + s, int(spans[b].ctypes.data) + d, size))   # many overlap at 0..128
    if seed % 3 == 0 and not one_size:
        flat.insert(int(rng.integers(0, len(flat) + 1)), (8, 16, 0))   # empty, outside every span
    src, dst, sizes = ([int(x) for x in column] for column in zip(*flat, strict=True))
    expected = {int(span.ctypes.data): span.copy() for span in spans}
    reference_copy(expected, src, dst, sizes)

    def grouped(*args: object, **kwargs: object) -> None:
        raise AssertionError("the grouped path ran for a copy of few descriptors per span pair")

    if one_size:   # out of group order, and the sized plan (resolved in one pass) must carry the copy
        keys = [(span_start(be, a), span_start(be, b)) for a, b in zip(src, dst, strict=True)]
        assert keys != sorted(keys)
        monkeypatch.setattr(_simcopy, "_move_each", grouped)
        monkeypatch.setattr(_simcopy.CopyPlan, "execute", grouped)

    assert len(src) <= SMALL_BATCH or pieces(be, src, dst) * EACH_MAX_PER_PAIR >= len(src)
    monkeypatch.setattr(_simcopy, "_Batch", grouped)
    timed_copy(be, src, dst, sizes)
    assert not be.violations
    for span in spans:
        np.testing.assert_array_equal(span, expected[int(span.ctypes.data)])


def span_start(be: SimBackend, addr: int) -> int:
    """The start of the live span holding ``addr`` (-1: none)."""
    span = be._memory.span_holding(addr, 0)
    return -1 if span is None else span.start


def pieces(be: SimBackend, src: list[int], dst: list[int]) -> int:
    """How many runs of one (source span, destination span) pair the descriptors come in."""
    keys = [(span_start(be, s), span_start(be, d)) for s, d in zip(src, dst, strict=True)]
    return 1 + sum(a != b for a, b in itertools.pairwise(keys))


def test_sim_sized_disjointness_matches_the_set_test_on_group_ordered_spans() -> None:
    """Whether a copy must stage its reads (a span both read and written): one bisection when the copy reads one
    span or writes one, else a set test -- the same answer as the set test for every group-ordered copy."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        n = int(rng.integers(1, 12))
        shape = int(rng.integers(0, 3))   # one source span, one destination span, or any
        sources = [int(rng.integers(0, 5))] * n if shape == 0 else rng.integers(0, 5, n).tolist()
        destinations = [int(rng.integers(0, 5))] * n if shape == 1 else rng.integers(0, 5, n).tolist()
        pairs = sorted(zip(sources, destinations, strict=True))   # group order
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        assert _simsized._disjoint(src, dst) == set(src).isdisjoint(dst), (src, dst)


@pytest.mark.parametrize("one", ["source", "destination"])
def test_sim_sized_copies_from_or_to_one_span_read_every_source_first(one: str) -> None:
    """A copy of one size from one span (or to one span) that also writes (reads) that span: every source is read
    before any destination is written, as the reference does, whichever side is the single span."""
    be, size, count = SimBackend(), 64, SMALL_BATCH + 8
    spans = random_spans(be, np.random.default_rng(9), [(64, size), (64, size), (64, size)], [])
    base = [int(s.ctypes.data) for s in spans]
    rows = [(k * 7) % 64 for k in range(count)]
    if one == "source":   # reads rows of span 0; writes span 0 first (group order), then rows the others read
        src = [base[0] + r * size for r in rows]
        dst = [base[k % 3] + rows[(k + 1) % count] * size for k in range(count)]
    else:   # writes rows of span 0 that later descriptors of its first group read
        src = [base[k % 3] + rows[k] * size for k in range(count)]
        dst = [base[0] + rows[(k + 3) % count] * size for k in range(count)]
    expected = {b: s.copy() for b, s in zip(base, spans, strict=True)}
    reference_copy(expected, src, dst, [size] * count)
    plan, _ = be._memory.plan(*(np.array(v, dtype=np.int64) for v in (src, dst, [size] * count)))
    assert isinstance(plan, SizedPlan)
    timed_copy(be, src, dst, [size] * count)
    assert not be.violations
    for b, span in zip(base, spans, strict=True):
        np.testing.assert_array_equal(span, expected[b])


@pytest.mark.parametrize("count", [SMALL_BATCH - 4, SMALL_BATCH + 8, 40])
def test_sim_copy_reads_only_its_count_of_a_larger_buffer(count: int) -> None:
    """A copy of the first ``count`` descriptors of a buffer that holds more (valid ones after them) moves those
    only, and the race detector sees only their ranges: another stream's write of the bytes the later
    descriptors would touch is no race (every path: per descriptor, sized, grouped)."""
    be, size, capacity = SimBackend(), 64, 48
    source, target = (np.asarray(be.empty_device((capacity, size))) for _ in range(2))
    source[:] = np.arange(capacity, dtype=np.uint8)[:, None] + 1
    base_src, base_dst = int(source.ctypes.data), int(target.ctypes.data)
    buf = be.alloc_descriptors(capacity)
    rows = np.arange(capacity, dtype=np.int64)
    buf.fill(base_src + rows * size, base_dst + rows * size, np.full(capacity, size, dtype=np.int64))
    stream, end = be.create_stream(), be.create_event()
    be.copy_batch(stream, buf, count)
    be.enqueue_compute_write(target[count:], list(range(capacity - count)), 7, delay=0.0)   # unordered with it
    be.record(end, stream)
    be.synchronize(end)
    be.sleep(1.0)
    assert not be.violations
    np.testing.assert_array_equal(target[:count], source[:count])
    assert (target[count:] == 7).all()
