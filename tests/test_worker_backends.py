"""The worker's round-trip, ordering and shutdown suite, run on every backend: the sim always, CuPy on a GPU.

The GPU variants are marked ``gpu`` (skipped without CuPy and a usable device). A "slow compute write" is the
sim's ``enqueue_compute_write`` or, on CuPy, a kernel spinning on a host flag followed by a write on the compute
stream, released only after the transfer was submitted: a transfer that did not wait for the compute stream would
copy stale bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import _cupy_spin as spin
import numpy as np
import pytest
from _support import cspec, gspec

import kvoffload_ref as kv

PAGE = 4096
BLOCKS = 64
CHUNKS = 16

BACKENDS = ["sim", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    be = kv.get_backend(request.param)
    if request.param == "cupy":
        be.warm_up()
    yield be


def _worker(be: Any, layout: kv.KVCacheLayout, bpc: int, timeout: float = 5.0) -> tuple[Any, list[Any],
                                                                                           list[np.ndarray]]:
    rng = np.random.default_rng(7)
    host = [rng.integers(0, 256, (BLOCKS, rb), dtype=np.uint8) for rb in layout.tensor_page_bytes]
    gpu = [be.from_host(h) for h in host]
    w = kv.create_worker(be, gpu, layout, blocks_per_chunk=bpc, num_cpu_chunks=CHUNKS,
                         policy=kv.ShutdownPolicy(timeout=timeout))
    return w, gpu, host


def _delayed_write(be: Any, dev: Any, row: int, value: int) -> Callable[[], None]:
    """Queue a write of ``value`` into ``dev[row]`` on the compute stream that lands only later."""
    if be.name == "sim":
        be.enqueue_compute_write(dev, [row], value, delay=0.5)
        return lambda: None
    scratch = be.empty_device((1, 16))
    scratch[0] = value  # load CuPy's fill kernel now: a module load while the spin runs could stall
    be.to_host(scratch)
    flag = spin.alloc_spin_flag(be)
    spin.enqueue_spin(be, be.current_stream(), flag, timeout=10.0)
    dev[row] = value  # a kernel on the current (compute) stream, behind the spin

    def release() -> None:
        flag.release()
        be.to_host(dev)  # waits for the compute stream
        spin.free_spin_flag(be, flag)

    return release


def _layout(num: int = 2, page: int = PAGE) -> kv.KVCacheLayout:
    return kv.KVCacheLayout(tensor_page_bytes=(page,) * num, groups=(tuple(kv.LayerRef(t, page)
                                                                            for t in range(num)),))


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.parametrize(("bpc", "index", "src", "cpu"), [
    (1, 0, [5, 9, 1, 3], [10, 7, 2, 0]),
    (3, 0, [5, 9, 1, 3], [10, 7]),
    (3, 2, [5, 9, 1, 3], [10, 7]),
    (3, 1, [5, 9, 1, 3, 4, 6], [4, 0, 15]),
])
def test_backends_round_trip_is_byte_exact(backend: Any, bpc: int, index: int, src: list[int],
                                           cpu: list[int]) -> None:
    w, gpu, host = _worker(backend, _layout(), bpc)
    dst = [40 + i for i in range(len(src))]
    w.submit_store(1, gspec(src, index), cspec(cpu))
    w.wait({1}, timeout=5.0)
    w.submit_load(2, cspec(cpu), gspec(dst, index))
    w.wait({2}, timeout=5.0)
    results = w.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
        (1, True, len(src) * 2 * PAGE), (2, True, len(src) * 2 * PAGE)]
    assert all(r.transfer_time is not None and r.transfer_time > 0 for r in results)
    for t in range(2):
        after = backend.to_host(gpu[t])
        np.testing.assert_array_equal(after[dst], host[t][src])
        untouched = np.setdiff1d(np.arange(BLOCKS), dst)
        np.testing.assert_array_equal(after[untouched], host[t][untouched])
    report = w.shutdown()
    assert (report.region, report.device_sync) == ("released", "not_needed")
    assert not backend.ledger.live()


def test_backends_round_trip_multi_group_padded(backend: Any) -> None:
    layout = kv.KVCacheLayout(tensor_page_bytes=(1024, 2048, 512),
                              groups=((kv.LayerRef(0, 1000),), (kv.LayerRef(1, 2048),), (kv.LayerRef(2, 512),)))
    w, gpu, host = _worker(backend, layout, 2)
    src = kv.GPULoadStoreSpec([3, 4, 10, 11, 12], group_sizes=(2, 0, 3), block_indices=(0, 0, 1))
    dst = kv.GPULoadStoreSpec([30, 31, 50, 51, 52], group_sizes=(2, 0, 3), block_indices=(0, 0, 1))
    w.submit_store(1, src, cspec([6, 1, 9]))
    w.wait({1}, timeout=5.0)
    w.submit_load(2, cspec([6, 1, 9]), dst)
    w.wait({2}, timeout=5.0)
    assert all(r.success for r in w.get_finished())
    after = [backend.to_host(a) for a in gpu]
    np.testing.assert_array_equal(after[0][[30, 31], :1000], host[0][[3, 4], :1000])
    np.testing.assert_array_equal(after[0][[30, 31], 1000:], host[0][[30, 31], 1000:])  # padding untouched
    np.testing.assert_array_equal(after[1], host[1])
    np.testing.assert_array_equal(after[2][[50, 51, 52]], host[2][[10, 11, 12]])
    w.shutdown()


@pytest.mark.rule("R4")
def test_backends_store_waits_for_the_compute_stream(backend: Any) -> None:
    w, gpu, _ = _worker(backend, _layout(), 1)
    release = _delayed_write(backend, gpu[0], 5, 0xAB)
    w.submit_store(1, gspec([5]), cspec([2]))
    release()
    w.wait({1}, timeout=5.0)
    assert (w.cpu_snapshot()[0][2] == 0xAB).all()
    w.shutdown()


@pytest.mark.rule("R4")
def test_backends_load_waits_for_the_compute_stream(backend: Any) -> None:
    w, gpu, host = _worker(backend, _layout(), 1)
    w.submit_store(1, gspec([5]), cspec([2]))
    w.wait({1}, timeout=5.0)
    release = _delayed_write(backend, gpu[0], 9, 0x11)
    w.submit_load(2, cspec([2]), gspec([9]))
    release()
    w.wait({2}, timeout=5.0)
    np.testing.assert_array_equal(backend.to_host(gpu[0])[9], host[0][5])
    w.shutdown()


@pytest.mark.rule("R4")
def test_backends_one_direction_runs_in_submission_order(backend: Any) -> None:
    w, _, host = _worker(backend, _layout(), 1)
    for job in range(1, 17):
        w.submit_store(job, gspec([job]), cspec([0]))
    w.wait(range(1, 17), timeout=5.0)
    np.testing.assert_array_equal(w.cpu_snapshot()[0][0], host[0][16])
    assert [r.job_id for r in w.get_finished()] == list(range(1, 17))
    w.shutdown()


@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
def test_backends_hung_transfer_shutdown_is_bounded_and_quarantines(backend: Any) -> None:
    """An emulated hang (FaultyBackend) on every backend: bounded shutdown, region quarantined."""
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=2)])
    faulty = kv.FaultyBackend(backend, plan)
    w, _, _ = _worker(faulty, _layout(), 1, timeout=0.5)
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_load(2, cspec([1]), gspec([2]))
    report = w.shutdown()
    assert report.elapsed <= 0.5 + 0.05
    assert (report.region, report.device_sync, report.load.abandoned) == ("quarantined", "timeout", 1)
    assert backend.ledger.live() == {}


@pytest.mark.gpu
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R13")
def test_backends_real_never_completing_transfer_on_the_gpu() -> None:
    """A kernel spinning on a host flag holds the compute stream; a load queued behind it never completes.

    Shutdown returns within its deadline and quarantines the region; then the test releases the flag, the GPU
    drains, and only then is the quarantined memory released (by hand, as a process exit would).
    """
    be = kv.get_backend("cupy")
    be.warm_up()
    w, gpu, _ = _worker(be, _layout(), 1, timeout=0.5)
    w.submit_store(1, gspec([1]), cspec([1]))
    w.wait({1}, timeout=5.0)
    flag = spin.alloc_spin_flag(be)
    spin.enqueue_spin(be, be.current_stream(), flag, timeout=30.0)
    w.submit_load(2, cspec([1]), gspec([2]))
    report = w.shutdown()
    assert 0.5 <= report.elapsed <= 0.5 + 0.05, report.elapsed
    assert (report.region, report.device_sync, report.load.abandoned) == ("quarantined", "timeout", 1)
    flag.release()
    be.to_host(gpu[0])  # the compute stream drains now
    region = w._core.region
    assert be.prove_idle([be.current_stream()], be.monotonic() + 5.0)
    assert region._release_steps() == []  # what process exit would do, now that the device is idle
    assert flag.state == 1
    spin.free_spin_flag(be, flag)
