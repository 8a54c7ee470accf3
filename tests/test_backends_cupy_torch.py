"""GPU tests of the CuPy backend with torch tensors and a torch compute stream (kvoffload_ref/backends/cupy.py,
_cupy_tensors.py, _cupy_interop.py).

torch is never a dependency: the module is skipped without it, and every test is marked ``gpu`` (skipped by
conftest.py without CuPy and a usable GPU). What they check, as a research prototype uses the worker:

* a KV cache of torch bf16 tensors ``(num_blocks, block_size, num_heads, head_dim)``, several layers in two
  KV-cache groups, stored and loaded back byte-exact through the worker;
* the model's write on a non-default torch stream just before a store is what the store copies (R4), with
  ``create_worker(..., compute_stream=torch_stream)``: a spin kernel holds the torch stream, the write is queued
  behind it, and the store must not finish before the spin is released;
* a hung transfer (the torch stream never finishes) is quarantined within the shutdown timeout, with the shutdown
  run from another thread (R11, R12);
* zero-copy views: the geometry is the tensor's own memory (padded views included), a DLPack-only tensor works,
  and a non-contiguous, host or wrongly placed tensor is refused naming it (R7).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import _cupy_spin as spin
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends import cupy as cb
from kvoffload_ref.backends.base import poll_until
from kvoffload_ref.errors import InvalidTransferError

torch: Any = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

DEADLINE = 30.0  # seconds: generous bound for work that must complete
NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 64, 16, 8, 64
PAGE = BLOCK_SIZE * NUM_HEADS * HEAD_DIM * 2  # bf16: 16 KiB per block per layer
GROUPS = ((0, 1), (2, 3, 4))  # two KV-cache groups: layers 0-1 and layers 2-4
BPC = 2  # GPU blocks per CPU chunk


@pytest.fixture(scope="module")
def backend() -> Iterator[cb.CupyBackend]:
    be = cb.CupyBackend(0)
    assert be.kernel_unavailable is None, be.kernel_unavailable
    spin.warm_spin(be)
    yield be
    be.release_cached_memory()


def kv_cache(seed: int) -> list[Any]:
    """One bf16 tensor per layer, random contents (no NaNs: compared bitwise anyway)."""
    gen = torch.Generator(device="cuda:0").manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
    layers = sum(len(g) for g in GROUPS)
    return [torch.randn(shape, generator=gen, device="cuda:0", dtype=torch.bfloat16) for _ in range(layers)]


def layout() -> Any:
    return kv.KVCacheLayout(tensor_page_bytes=(PAGE,) * sum(len(g) for g in GROUPS),
                            groups=[[kv.LayerRef(t, PAGE) for t in g] for g in GROUPS])


def bits(t: Any) -> Any:
    """A bitwise view (bf16 -> int16) so equality is byte equality."""
    return t.view(torch.int16)


def same_blocks(tensors: list[Any], group: tuple[int, ...], dst: list[int], src: list[int]) -> bool:
    return all(torch.equal(bits(tensors[t][dst]), bits(tensors[t][src])) for t in group)


@pytest.mark.rule("R16")
def test_torch_bf16_kv_cache_round_trip_two_groups(backend: cb.CupyBackend) -> None:
    tensors = kv_cache(1)
    torch.cuda.synchronize()
    original = [t.clone() for t in tensors]
    stored = kv.GPULoadStoreSpec([5, 9, 1, 3, 40, 41, 17], group_sizes=(4, 3), block_indices=(0, 1))
    # group 0: 4 blocks from sub-block 0 -> 2 chunks; group 1: 3 blocks from sub-block 1 -> 2 chunks
    chunks = kv.CPULoadStoreSpec([10, 7, 3, 12])
    loaded = kv.GPULoadStoreSpec([20, 21, 22, 23, 50, 51, 52], group_sizes=(4, 3), block_indices=(0, 1))
    with kv.create_worker(backend, tensors, layout(), blocks_per_chunk=BPC, num_cpu_chunks=16,
                          policy=kv.ShutdownPolicy(timeout=5.0), compute_stream=torch.cuda.current_stream()) as w:
        assert w.submit_store(1, stored, chunks)
        w.wait({1}, timeout=DEADLINE)
        assert w.submit_load(2, chunks, loaded)
        w.wait({2}, timeout=DEADLINE)
        results = w.get_finished()
    report = w.shutdown()
    torch.cuda.synchronize()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    assert same_blocks(tensors, GROUPS[0], [20, 21, 22, 23], [5, 9, 1, 3])
    assert same_blocks(tensors, GROUPS[1], [50, 51, 52], [40, 41, 17])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (20, 21, 22, 23, 50, 51, 52)]
    assert all(torch.equal(bits(t[untouched]), bits(o[untouched])) for t, o in zip(tensors, original, strict=True))
    assert not any(torch.equal(bits(tensors[t][50]), bits(original[t][50])) for t in GROUPS[1])
    assert report.region == "released"
    assert backend.ledger.live() == {}


@contextlib.contextmanager
def held(backend: cb.CupyBackend, stream: Any) -> Iterator[tuple[spin.SpinFlag, Any]]:
    """Hold ``stream`` with a spin kernel; yields the flag and an event recorded after the spin. On exit the flag
    is released, and freed once that event completed (else leaked on purpose: the kernel may still read it)."""
    handle = backend.compute_stream(stream)
    flag = spin.alloc_spin_flag(backend)
    done = backend.create_event()
    try:
        spin.enqueue_spin(backend, handle, flag, timeout=20.0)
        backend.record(done, handle)
        yield flag, done
    finally:
        flag.release()
        if poll_until(backend, lambda: backend.query(done), backend.monotonic() + DEADLINE):
            spin.free_spin_flag(backend, flag)
        backend.destroy_event(done)


@pytest.mark.rule("R4")
def test_torch_write_on_a_non_default_stream_before_a_store_is_what_is_stored(backend: cb.CupyBackend) -> None:
    tensors = kv_cache(2)
    model = torch.cuda.Stream()
    blocks = [4, 5, 6, 7]
    with torch.cuda.stream(model):  # the model's write, once in advance: loads torch's fill kernel now
        for t in tensors:
            t.narrow(0, 4, 4).fill_(1.0)
    torch.cuda.synchronize()
    w = kv.create_worker(backend, tensors, layout(), blocks_per_chunk=BPC, num_cpu_chunks=16,
                         policy=kv.ShutdownPolicy(timeout=5.0), compute_stream=model)
    try:
        with held(backend, model) as (flag, spin_done):
            with torch.cuda.stream(model):  # queued behind the spin: not yet written when the store is submitted
                for t in tensors:
                    t.narrow(0, 4, 4).fill_(3.0)
            both = kv.GPULoadStoreSpec(blocks + blocks, group_sizes=(4, 4), block_indices=(0, 0))
            assert w.submit_store(1, both, kv.CPULoadStoreSpec([0, 1, 2, 3]))
            assert w.get_finished() == [], "the store finished while the model's stream was held"
            assert backend.query(spin_done) is False, "the spin ended early: the test proved nothing"
            flag.release()
            w.wait({1}, timeout=DEADLINE)
            assert flag.state == 1, "the spin kernel timed out instead of being released"
        back = kv.GPULoadStoreSpec([30, 31, 32, 33] * 2, group_sizes=(4, 4), block_indices=(0, 0))
        assert w.submit_load(2, kv.CPULoadStoreSpec([0, 1, 2, 3]), back)
        w.wait({2}, timeout=DEADLINE)
        results = w.get_finished()
    finally:
        report = w.shutdown()
    torch.cuda.synchronize()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    three = torch.full((4, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), 3.0, device="cuda:0", dtype=torch.bfloat16)
    for t in tensors:
        assert torch.equal(bits(t[30:34]), bits(three)), "the store copied the KV before the model wrote it"
    assert report.region == "released"


@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
def test_torch_hung_transfer_is_quarantined_within_its_timeout(backend: cb.CupyBackend) -> None:
    """The torch compute stream never finishes: a store waits on it; shutdown, run from another thread, returns
    within the timeout and quarantines (the proof uses the worker's compute stream, not the thread's)."""
    tensors = kv_cache(3)
    model = torch.cuda.Stream()
    torch.cuda.synchronize()
    timeout = 0.5
    w = kv.create_worker(backend, tensors, layout(), blocks_per_chunk=BPC, num_cpu_chunks=16,
                         policy=kv.ShutdownPolicy(timeout=timeout, on_unproven="quarantine"), compute_stream=model)
    with held(backend, model) as (flag, spin_done):
        assert w.submit_store(1, kv.GPULoadStoreSpec([5, 9, 6, 8], (2, 2), (0, 0)), kv.CPULoadStoreSpec([3, 4]))
        outcome: dict[str, Any] = {}

        def shut_down() -> None:
            start = backend.monotonic()
            outcome["report"] = w.shutdown()
            outcome["took"] = backend.monotonic() - start

        thread = threading.Thread(target=shut_down)
        thread.start()
        thread.join(timeout + DEADLINE)
        assert not thread.is_alive(), "shutdown did not return"
        assert outcome["took"] < timeout + 1.0, f"shutdown took {outcome['took']:.2f} s"
        report = outcome["report"]
        spin.assert_quarantined_while_spinning(backend, report, flag, spin_done, DEADLINE)
    assert backend.ledger.live() == {}, "only quarantined resources may remain"


def test_torch_tensor_geometry_is_its_own_memory(backend: cb.CupyBackend) -> None:
    t = torch.empty((NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), device="cuda:0", dtype=torch.bfloat16)
    g = backend.array_info(t)
    assert (g.ptr, g.rows, g.row_bytes, g.row_stride) == (t.data_ptr(), NUM_BLOCKS, PAGE, PAGE)
    big = torch.empty((8, BLOCK_SIZE + 4, NUM_HEADS, HEAD_DIM), device="cuda:0", dtype=torch.float16)
    padded = big[:, :BLOCK_SIZE]  # blocks padded by 4 tokens: the block stride exceeds the block
    g = backend.array_info(padded)
    assert (g.ptr, g.rows, g.row_bytes, g.row_stride) == (big.data_ptr(), 8, PAGE, (BLOCK_SIZE + 4) * PAGE // 16)
    big.copy_(torch.randn(big.shape, device="cuda:0", dtype=torch.float16))
    torch.cuda.synchronize()
    assert backend.to_host(padded).tobytes() == padded.contiguous().view(torch.uint8).cpu().numpy().tobytes()


class DlpackOnly:
    """A tensor offering only DLPack (as a framework whose dtype has no CUDA-array-interface typestr)."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()


def test_torch_dlpack_only_tensor_is_viewed_zero_copy(backend: cb.CupyBackend) -> None:
    t = torch.empty((8, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), device="cuda:0", dtype=torch.float16)
    g = backend.array_info(DlpackOnly(t))
    assert (g.ptr, g.rows, g.row_bytes, g.row_stride) == (t.data_ptr(), 8, PAGE, PAGE)
    as_bytes = DlpackOnly(t.view(torch.uint8))  # any dtype CuPy lacks can be passed as a byte view
    assert backend.array_info(as_bytes) == g


@pytest.mark.rule("R7")
def test_torch_tensor_refusals_name_the_tensor(backend: cb.CupyBackend) -> None:
    t = torch.empty((8, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), device="cuda:0", dtype=torch.float16)
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[1\]: a block is not contiguous"):
        backend.array_info(t.transpose(2, 3), index=1)
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[2\]: is in host memory"):
        backend.array_info(torch.empty((8, 64), dtype=torch.bfloat16), index=2)
    if torch.cuda.device_count() > 1:
        with pytest.raises(InvalidTransferError, match=r"^compute_stream: stream is on cuda:1"):
            backend.compute_stream(torch.cuda.Stream(device=1))
    assert backend.compute_stream(torch.cuda.Stream()).ptr != 0  # type: ignore[attr-defined]


@pytest.mark.rule("R23")
def test_torch_kernel_after_order_after_reads_exactly_the_loaded_bytes(backend: cb.CupyBackend) -> None:
    """A torch kernel on a non-default stream, enqueued after ``order_after`` and without any host wait, reads the
    bytes the load wrote: the load is held behind a spin on the model's stream (R4), the reader's clone waits for it
    on the device."""
    tensors = kv_cache(3)
    model, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(reader):  # loads torch's copy kernel now, not while the spin runs
        [t[40:44].clone() for t in tensors]
    torch.cuda.synchronize()
    w = kv.create_worker(backend, tensors, layout(), blocks_per_chunk=BPC, num_cpu_chunks=16,
                         policy=kv.ShutdownPolicy(timeout=5.0), compute_stream=model)
    try:
        assert w.submit_store(1, kv.GPULoadStoreSpec([4, 5, 6, 7] * 2, group_sizes=(4, 4), block_indices=(0, 0)),
                              kv.CPULoadStoreSpec([0, 1, 2, 3]))
        w.wait({1}, timeout=DEADLINE)
        expected = [bits(t[4:8]).clone() for t in tensors]
        with held(backend, model) as (flag, spin_done):
            dst = kv.GPULoadStoreSpec([40, 41, 42, 43] * 2, group_sizes=(4, 4), block_indices=(0, 0))
            assert w.submit_load(2, kv.CPULoadStoreSpec([0, 1, 2, 3]), dst)
            w.order_after([2], stream=reader)
            with torch.cuda.stream(reader):  # queued on the device behind the load's end
                seen = [t[40:44].clone() for t in tensors]
            assert backend.query(spin_done) is False, "the spin ended early: the test proved nothing"
            flag.release()
        reader.synchronize()
        w.wait({2}, timeout=DEADLINE)
        results = w.get_finished()
    finally:
        w.shutdown()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    for got, want in zip(seen, expected, strict=True):
        assert torch.equal(bits(got), want), "the reader ran before the load wrote its blocks"
