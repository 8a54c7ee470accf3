"""The worker in canonical mode (R24): TP=4 stores, TP=2 and TP=1 loads, byte-exact; writers; R7; a differential.

The proof runs in one process: one ``SharedRegion`` file opened by seven ranks (four TP=4 ranks, two TP=2 ranks,
one TP=1 rank), each with its own ``SimBackend``, with the replicated geometry (every rank maps the same canonical
rows: the canonical page does not depend on the parallel configuration). The TP=4 workers store, the others load
from the very same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.canonical import ByteRun, MappingError, PageMapping, verify_mappings
from kvoffload_ref.canonical_derive import LayerGeometry, ParallelContext, derive_layer
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.placement import check_transfer
from kvoffload_ref.planner import Planner
from kvoffload_ref.reference import create_reference_worker
from kvoffload_ref.region import HostRegion
from kvoffload_ref.shared_region import SharedRegion
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import create_worker

BS, D, E, LATENT = 4, 8, 2, 24  # tokens per block, head size, element size (bf16), MLA latent elements
BPC, CHUNKS, GPU_BLOCKS = 2, 8, 16
LOGICAL = 6  # blocks stored and loaded back
SKIP = 1  # the group's block index: the first block sits at sub-block 1 of its first chunk
CPU_IDS = [3, 0, 5, 2]  # ceil((LOGICAL + SKIP) / BPC) chunks
STORE_GPU = [9, 2, 14, 5, 0, 11]
LOAD_GPU = [1, 7, 3, 12, 6, 15]

Factory = Callable[..., Any]
WORKERS = [pytest.param(create_worker, id="engine"), pytest.param(create_reference_worker, id="reference")]


def _geometry(kind: str, heads: int, tp: int) -> LayerGeometry:
    if kind == "mla":
        return LayerGeometry("mla", block_size=BS, element_size=E, latent_size=LATENT)
    return LayerGeometry("split", block_size=BS, element_size=E, head_size=D, total_kv_heads=heads,
                         local_kv_heads=max(1, heads // tp))


def _full(kind: str, heads: int, seed: int = 7) -> npt.NDArray[np.uint8]:
    """The unsharded KV of LOGICAL blocks, never a zero byte: split NHD ``(blocks, 2, BS, heads, D*E)``, MLA
    ``(blocks, BS, LATENT*E)``."""
    rng = np.random.default_rng(seed)
    shape = (LOGICAL, BS, LATENT * E) if kind == "mla" else (LOGICAL, 2, BS, heads, D * E)
    return rng.integers(1, 256, shape, dtype=np.uint8)


def _local(full: npt.NDArray[np.uint8], kind: str, tp: int, rank: int) -> npt.NDArray[np.uint8]:
    """What TP rank ``rank`` of a TP=``tp`` model holds of each block: its heads (MLA: the whole latent)."""
    if kind == "mla":
        return full.reshape(LOGICAL, -1)
    heads = full.shape[3]
    if heads >= tp:
        lo, n = rank * (heads // tp), heads // tp
    else:
        lo, n = rank // (tp // heads), 1
    return np.ascontiguousarray(full[:, :, :, lo:lo + n, :]).reshape(LOGICAL, -1)


def _specs(gpu_ids: list[int]) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    return GPULoadStoreSpec(gpu_ids, group_sizes=(LOGICAL,), block_indices=(SKIP,)), CPULoadStoreSpec(CPU_IDS)


def _page_ids() -> list[tuple[int, int]]:
    """(chunk, sub-block) of each logical block."""
    return [(CPU_IDS[(SKIP + k) // BPC], (SKIP + k) % BPC) for k in range(LOGICAL)]


def _layout(page: int) -> KVCacheLayout:
    return KVCacheLayout([page], [[LayerRef(0, page)]])


class _Ranks:
    """Seven ranks of one engine over one shared file: TP=4 (ranks 0-3), TP=2 (4-5), TP=1 (6)."""

    def __init__(self, kind: str, heads: int, directory: str, engine: str) -> None:
        self.kind, self.heads = kind, heads
        self.maps = {tp: derive_layer("layer0", ParallelContext(tp=tp), _geometry(kind, heads, tp)) for tp in (4, 2, 1)}
        self.slots = [(4, r) for r in range(4)] + [(2, r) for r in range(2)] + [(1, 0)]
        canonical = CanonicalLayout([self.maps[1][0]])
        cpu_layout = canonical.cpu_layout(_layout(self.maps[1][0].local_page_size))
        for tp in (4, 2):  # the canonical page is the same under every TP size (parallelism-agnostic)
            assert CanonicalLayout([self.maps[tp][0]]).cpu_layout(_layout(self.maps[tp][0].local_page_size)) \
                == cpu_layout
        self.backends = [SimBackend() for _ in self.slots]
        self.regions = [SharedRegion.open(engine, backend=be, layout=cpu_layout, blocks_per_chunk=BPC,
                                          num_cpu_chunks=CHUNKS, rank=i, world_size=len(self.slots), replicated=True,
                                          directory=directory) for i, be in enumerate(self.backends)]

    def worker(self, factory: Factory, i: int, gpu: npt.NDArray[np.uint8]) -> Any:
        tp, rank = self.slots[i]
        mapping = self.maps[tp][rank]
        be = self.backends[i]
        return factory(be, [be.from_host(gpu)], _layout(mapping.local_page_size), blocks_per_chunk=BPC,
                       num_cpu_chunks=CHUNKS, region=self.regions[i], canonical=CanonicalLayout([mapping], rank=rank))

    def rows(self) -> npt.NDArray[np.uint8]:
        return self.regions[6].snapshot_rows()

    def close(self) -> None:
        for region in self.regions:
            if region.state.value == "caller_owned":
                region.release()


@pytest.fixture
def ranks_for(tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Callable[[str, int], _Ranks]]:
    made: list[_Ranks] = []

    def make(kind: str, heads: int) -> _Ranks:
        made.append(_Ranks(kind, heads, str(tmp_path), f"canon-{request.node.name[-40:]}-{len(made)}"
                           .replace("[", "-").replace("]", "")))
        return made[-1]

    yield make
    for ranks in made:
        ranks.close()


def _store(ranks: _Ranks, factory: Factory, i: int, full: npt.NDArray[np.uint8]) -> int:
    """Rank ``i`` stores the logical blocks from its GPU; returns the bytes its result reports."""
    tp, rank = ranks.slots[i]
    local = _local(full, ranks.kind, tp, rank)
    gpu = np.zeros((GPU_BLOCKS, local.shape[1]), dtype=np.uint8)
    gpu[STORE_GPU] = local
    worker = ranks.worker(factory, i, gpu)
    worker.submit_store(1, *_specs(STORE_GPU))
    worker.wait([1])
    (result,) = worker.get_finished()
    assert result.success and result.job_id == 1
    worker.shutdown()
    assert ranks.backends[i].violations == []
    return int(result.transfer_size)


def _load(ranks: _Ranks, factory: Factory, i: int, full: npt.NDArray[np.uint8]) -> None:
    """Rank ``i`` loads the logical blocks into fresh GPU blocks; they must be what its TP size's model holds."""
    tp, rank = ranks.slots[i]
    local = _local(full, ranks.kind, tp, rank)
    be = ranks.backends[i]
    gpu = be.from_host(np.zeros((GPU_BLOCKS, local.shape[1]), dtype=np.uint8))
    worker = factory(be, [gpu], _layout(local.shape[1]), blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS,
                     region=ranks.regions[i], canonical=CanonicalLayout([ranks.maps[tp][rank]], rank=rank))
    gpu_spec, cpu_spec = _specs(LOAD_GPU)
    worker.submit_load(2, cpu_spec, gpu_spec)
    worker.wait([2])
    (result,) = worker.get_finished()
    assert result.success and result.transfer_size == LOGICAL * local.shape[1]  # loads never filter
    got = be.to_host(gpu)
    worker.shutdown()
    np.testing.assert_array_equal(got[LOAD_GPU], local, err_msg=f"TP={tp} rank {rank}")
    assert not got[[b for b in range(GPU_BLOCKS) if b not in LOAD_GPU]].any()  # nothing else written
    assert be.violations == []


def _written(mapping: PageMapping, chunk: int, sub: int, row_stride: int) -> npt.NDArray[np.bool_]:
    """The bytes of the file's rows (flattened) that ``mapping``'s store of canonical page (chunk, sub) writes."""
    mask = np.zeros(CHUNKS * row_stride, dtype=np.bool_)
    _, can, sizes = mapping.fragments()
    base = chunk * row_stride + sub * mapping.canonical_page_size
    for c, n in zip(can.tolist(), sizes.tolist(), strict=True):
        mask[base + c: base + c + n] = True
    return mask


@pytest.mark.rule("R24")
@pytest.mark.parametrize("factory", WORKERS)
@pytest.mark.parametrize(("kind", "heads"), [("split", 4), ("split", 2), ("mla", 1)],
                         ids=["tp4-4heads", "tp4-2heads-replicated", "mla"])
def test_canonical_worker_tp4_store_loads_back_byte_exact_under_tp2_and_tp1(
        ranks_for: Callable[[str, int], _Ranks], factory: Factory, kind: str, heads: int) -> None:
    ranks = ranks_for(kind, heads)
    full = _full(kind, heads)
    row_stride = ranks.regions[0].geometry.row_stride
    writers: dict[int, list[int]] = {}  # canonical byte -> ranks that wrote it, page by page below
    before = ranks.rows().reshape(-1)
    assert not before.any()
    for i in range(4):  # TP=4, one rank after the other: the bytes each one changed are the bytes it copied
        tp, rank = ranks.slots[i]
        mapping = ranks.maps[tp][rank]
        reported = _store(ranks, factory, i, full)
        after = ranks.rows().reshape(-1)
        changed = after != before
        expected = np.zeros_like(changed)
        mine = [(c, j) for c, j in _page_ids() if mapping.is_writer(c * BPC + j)]
        for c, j in mine:
            expected |= _written(mapping, c, j, row_stride)
        np.testing.assert_array_equal(changed, expected, err_msg=f"rank {rank} wrote other bytes than its pages")
        assert reported == len(mine) * mapping.local_page_size  # byte count = what was copied
        if mapping.num_writers > 1:
            assert len(mine) < LOGICAL  # a non-writer's block copies nothing (and the job still completed)
        for byte in np.flatnonzero(changed).tolist():
            writers.setdefault(byte, []).append(rank)
        before = after
    # every canonical byte of every stored page written exactly once, by one rank per head shard
    stored = np.zeros(CHUNKS * row_stride, dtype=np.bool_)
    for c, j in _page_ids():
        stored[c * row_stride + j * ranks.maps[4][0].canonical_page_size:][:ranks.maps[4][0].canonical_page_size] = True
    assert sorted(writers) == np.flatnonzero(stored).tolist()
    assert all(len(w) == 1 for w in writers.values())
    shards = 4 if kind == "split" and heads >= 4 else (heads if kind == "split" else 1)
    for c, j in _page_ids():
        page = c * row_stride + j * ranks.maps[4][0].canonical_page_size
        who = {writers[b][0] for b in range(page, page + ranks.maps[4][0].canonical_page_size)}
        assert len(who) == shards  # exactly one rank per head shard (MLA: one rank in all)
    # the rows hold the unsharded model's pages
    rows = ranks.rows()
    for k, (c, j) in enumerate(_page_ids()):
        size = ranks.maps[4][0].canonical_page_size
        np.testing.assert_array_equal(rows[c, j * size:(j + 1) * size], full[k].reshape(-1))
    verify_mappings("layer0", ranks.maps[4])
    for i in (4, 5, 6):  # TP=2, TP=1: from the same bytes
        _load(ranks, factory, i, full)


@pytest.mark.rule("R24")
@pytest.mark.parametrize("factory", WORKERS)
def test_canonical_worker_refuses_bad_mappings_before_any_device_work(factory: Factory) -> None:
    page = 256
    layout = _layout(page)
    gap = PageMapping(512, page, (ByteRun(0, 0, 128, 1, 0, 0),))  # covers half the local page
    be = SimBackend()
    gpu = [be.empty_device((GPU_BLOCKS, page))]
    live = be.ledger.live()
    with pytest.raises(MappingError, match="gap in the local page at byte 128"):
        factory(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical=[gap])
    twice = PageMapping(512, page, (ByteRun(0, 0, 128, 1, 0, 0), ByteRun(128, 0, 128, 1, 0, 0)))  # both at 0
    with pytest.raises(MappingError, match=r"rank 0: the runs write canonical bytes \[0, 128\) twice"):
        factory(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical=[twice])
    good = PageMapping(512, page, (ByteRun(0, 256, page, 1, 0, 0),))
    with pytest.raises(InvalidTransferError, match="one per layout tensor"):
        factory(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical=[good, good])
    with pytest.raises(InvalidTransferError, match="does not match the canonical mapping"):
        factory(be, gpu, KVCacheLayout([page], [[LayerRef(0, 128)]]), blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS,
                canonical=[good])
    with pytest.raises(InvalidTransferError, match="canonical"):
        factory(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical="mapping")
    plain = HostRegion.allocate(be, layout, BPC, CHUNKS)  # rows of page * BPC: the canonical page does not fit
    with pytest.raises(InvalidTransferError, match="canonical page"):
        factory(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, region=plain, canonical=[good])
    assert plain.state.value == "caller_owned" and not plain.pinned
    plain.release()
    assert be.ledger.live() == live  # nothing acquired by the refused workers


def _replicated_rank1() -> CanonicalLayout:
    """TP=4 over 2 KV heads, rank 1: a non-writer of every even canonical page."""
    maps = derive_layer("layer0", ParallelContext(tp=4), _geometry("split", 2, 4))
    assert maps[1].num_writers == 2 and maps[1].writer_index == 1
    return CanonicalLayout([maps[1]], rank=1)


@pytest.mark.rule("R24")
def test_canonical_worker_planner_and_placement_give_the_same_descriptors() -> None:
    canonical = _replicated_rank1()
    mapping = canonical.mappings[0]
    layout = _layout(mapping.local_page_size)
    be = SimBackend()
    gpu = [be.array_info(be.empty_device((GPU_BLOCKS, mapping.local_page_size)))]
    region = HostRegion.allocate(be, canonical.cpu_layout(layout), BPC, CHUNKS)
    cpu = list(region.geometries())
    planner = Planner(layout, gpu, cpu, BPC, canonical)
    pairs: list[tuple[Direction, list[int]]] = [("store", STORE_GPU), ("load", LOAD_GPU)]
    for direction, gpu_ids in pairs:
        gpu_spec, cpu_spec = _specs(gpu_ids)
        src, dst = (gpu_spec, cpu_spec) if direction == "store" else (cpu_spec, gpu_spec)
        plan = planner.plan(direction, src, dst)
        moves = check_transfer(layout, direction, src, dst, [g.rows for g in gpu], [c.rows for c in cpu], BPC,
                               canonical)
        want = np.array([m.addresses(direction, gpu, cpu) for m in moves], dtype=np.int64).reshape(-1, 3)
        np.testing.assert_array_equal(np.stack([plan.src, plan.dst, plan.sizes], axis=1), want)
        assert plan.nbytes == sum(m.size for m in moves)
        blocks = sum(1 for c, j in _page_ids() if mapping.is_writer(c * BPC + j)) if direction == "store" else LOGICAL
        assert plan.num_ops == blocks * mapping.num_fragments
    region.release()


@pytest.mark.rule("R24")
def test_canonical_worker_differential_engine_and_reference_same_schedule_same_bytes() -> None:
    canonical = _replicated_rank1()
    page = canonical.mappings[0].local_page_size
    rng = np.random.default_rng(3)
    source = rng.integers(1, 256, (GPU_BLOCKS, page), dtype=np.uint8)
    outcomes = []
    for factory in (create_worker, create_reference_worker):
        be = SimBackend()
        gpu = be.from_host(source.copy())
        worker = factory(be, [gpu], _layout(page), blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical=canonical)
        gpu_spec, cpu_spec = _specs(STORE_GPU)
        worker.submit_store(1, gpu_spec, cpu_spec)
        worker.submit_store(2, GPULoadStoreSpec([4, 8], group_sizes=(2,), block_indices=(0,)), CPULoadStoreSpec([6]))
        worker.wait([1, 2])
        load_gpu, load_cpu = _specs(LOAD_GPU)
        worker.submit_load(3, load_cpu, load_gpu)
        worker.submit_load(4, CPULoadStoreSpec([6]), GPULoadStoreSpec([10, 13], group_sizes=(2,), block_indices=(0,)))
        worker.wait([3, 4])
        results = [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]
        snapshot = worker.cpu_snapshot()[0]
        worker.shutdown()
        outcomes.append((results, snapshot, be.to_host(gpu), be.violations))
    (engine, reference) = outcomes
    assert engine[0] == reference[0]
    assert engine[0][1][2] == page  # job 2: chunk 6's pages 12 and 13; rank 1 writes page 13 only
    np.testing.assert_array_equal(engine[1], reference[1])
    np.testing.assert_array_equal(engine[2], reference[2])
    assert engine[3] == reference[3] == []


@pytest.mark.rule("R24")
@pytest.mark.parametrize("factory", WORKERS)
def test_canonical_worker_race_detector_sees_fragment_ranges(factory: Factory) -> None:
    canonical = _replicated_rank1()
    page = canonical.mappings[0].local_page_size
    be = SimBackend()
    worker = factory(be, [be.from_host(np.ones((GPU_BLOCKS, page), dtype=np.uint8))], _layout(page),
                     blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical=canonical)
    # rank 1 writes odd canonical pages: chunk 6 sub-block 1 (page 13) is written by the store, read by the load
    worker.submit_store(1, GPULoadStoreSpec([4, 8], group_sizes=(2,), block_indices=(0,)), CPULoadStoreSpec([6]))
    worker.submit_load(2, CPULoadStoreSpec([6]), GPULoadStoreSpec([10], group_sizes=(1,), block_indices=(1,)))
    worker.wait([1, 2])
    worker.get_finished()
    worker.shutdown()
    races = [v for v in be.violations if v.kind == "dma_race"]
    assert races and races[0].tag == ("load", 2)  # the load read canonical bytes the pending store writes
    # the same pair on a page this rank does not write (page 12, sub-block 0): the store copies nothing there
    be = SimBackend()
    worker = factory(be, [be.from_host(np.ones((GPU_BLOCKS, page), dtype=np.uint8))], _layout(page),
                     blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, canonical=canonical)
    worker.submit_store(1, GPULoadStoreSpec([4], group_sizes=(1,), block_indices=(0,)), CPULoadStoreSpec([6]))
    worker.submit_load(2, CPULoadStoreSpec([6]), GPULoadStoreSpec([10], group_sizes=(1,), block_indices=(0,)))
    worker.wait([1, 2])
    results = {r.job_id: r.transfer_size for r in worker.get_finished()}
    worker.shutdown()
    assert results == {1: 0, 2: page} and be.violations == []


@pytest.mark.rule("R24")
def test_canonical_worker_planner_mixed_layers_two_groups_match_placement() -> None:
    """Refs with different fragment counts and writers (a split layer and an MLA layer) and two groups sharing a
    tensor: the vectorized planner's per-ref path against the plain rule, both directions, two ranks."""
    for rank in (1, 2):
        split = derive_layer("s", ParallelContext(tp=4), _geometry("split", 2, 4))[rank]
        mla = derive_layer("m", ParallelContext(tp=4), _geometry("mla", 1, 4))[rank]
        canonical = CanonicalLayout([split, mla], rank=rank)
        pages = [split.local_page_size, mla.local_page_size]
        layout = KVCacheLayout(pages, [[LayerRef(0, pages[0]), LayerRef(1, pages[1])], [LayerRef(1, pages[1])]])
        be = SimBackend()
        gpu = [be.array_info(be.empty_device((GPU_BLOCKS, p))) for p in pages]
        region = HostRegion.allocate(be, canonical.cpu_layout(layout), BPC, CHUNKS)
        cpu = list(region.geometries())
        planner = Planner(layout, gpu, cpu, BPC, canonical)
        gpu_spec = GPULoadStoreSpec([3, 4, 5, 9, 1], group_sizes=(3, 2), block_indices=(1, 0))
        cpu_spec = CPULoadStoreSpec([7, 2, 0])
        pairs: list[tuple[Direction, Any, Any]] = [("store", gpu_spec, cpu_spec), ("load", cpu_spec, gpu_spec)]
        for direction, src, dst in pairs:
            plan = planner.plan(direction, src, dst)
            moves = check_transfer(layout, direction, src, dst, [g.rows for g in gpu], [c.rows for c in cpu], BPC,
                                   canonical)
            want = np.array([m.addresses(direction, gpu, cpu) for m in moves], dtype=np.int64).reshape(-1, 3)
            np.testing.assert_array_equal(np.stack([plan.src, plan.dst, plan.sizes], axis=1), want)
            assert plan.nbytes == sum(m.size for m in moves) and plan.num_ops == len(moves)
        region.release()
