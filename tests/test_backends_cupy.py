"""Tests of the CuPy backend (kvoffload_ref/backends/cupy.py).

Three groups:

* CPU tests that need neither CuPy nor a GPU: the backend driven through a fake ``cupy`` module whose runtime
  executes copies at once on host memory and can be told to fail (error mapping, ledger accounting, strict
  query, path choice, coalescing, bounded proof).
* CPU tests about the no-GPU behaviour: CuPy missing (simulated), CuPy present without a device, and an NVRTC
  syntax check of the kernels when libnvrtc is installed.
* ``@pytest.mark.gpu`` tests on a real device (skipped by conftest.py without CuPy and a usable GPU): byte-exact
  round trips through both copy paths, ordering after the compute stream, a transfer that never completes until
  the host releases it, strict error mapping, and the ledger.

CuPy is never imported at module level, so collection works on a machine without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import itertools
import mmap
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import _cupy_spin as spin
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload_ref.backends import cupy as cb
from kvoffload_ref.backends._cupy_copy import KERNEL_SOURCE, SpanSet
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, poll_until
from kvoffload_ref.errors import DeviceError, InvalidTransferError, LifecycleError, RegistrationRefused

U8 = npt.NDArray[np.uint8]


# ---------------------------------------------------------------------------------------------------------------
# A fake cupy module: enough of cupy.cuda.runtime for the backend, executing copies synchronously on host memory.
# ---------------------------------------------------------------------------------------------------------------
class FakeCudaError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"fakeCudaError {status}")
        self.status = status


class FakeDeviceArray:
    """A 'device' array that lives in host memory (the fake runtime copies with memmove)."""

    def __init__(self, host: U8) -> None:
        self.host = host
        self.shape = host.shape
        self.strides = host.strides
        self.dtype = host.dtype
        self.itemsize = host.itemsize
        self.ndim = host.ndim
        self.flags = host.flags
        self.data = types.SimpleNamespace(ptr=host.ctypes.data)
        self.device = types.SimpleNamespace(id=0)

    def __getitem__(self, key: Any) -> FakeDeviceArray:
        return FakeDeviceArray(self.host[key])

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "strides": None if self.flags.c_contiguous else self.strides, "version": 3}


class FakeRuntime:
    CUDARuntimeError = FakeCudaError

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}            # runtime function name -> status it raises
        self.query_status: dict[int, int] = {}    # event -> status eventQuery returns (default 0)
        self.calls: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}
        self.host_allocs: set[int] = set()
        self.pointer_device: dict[int, int] = {}  # pointer -> the device pointerGetAttributes reports
        self.device = 0
        self._buffers: dict[int, Any] = {}
        self._handles = itertools.count(0x1000, 0x10)

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise FakeCudaError(self.fail[name])

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)

    def getDeviceCount(self) -> int:
        self._call("getDeviceCount")
        return 1

    def getDevice(self) -> int:
        return self.device

    def setDevice(self, device: int) -> None:
        self.device = device

    def deviceGetAttribute(self, attr: int, device: int) -> int:
        self._call("deviceGetAttribute", attr, device)
        return {91: 1, 16: 4}.get(attr, 0)

    def getDeviceProperties(self, device: int) -> dict[str, bytes]:
        return {"name": b"Fake GPU"}

    def _alloc(self, name: str, nbytes: int) -> int:
        self._call(name, nbytes)
        raw = (ctypes.c_byte * max(nbytes, 1))()
        ptr = ctypes.addressof(raw)
        self._buffers[ptr] = raw
        return ptr

    def malloc(self, nbytes: int) -> int:
        return self._alloc("malloc", nbytes)

    def hostAlloc(self, nbytes: int, flags: int) -> int:
        ptr = self._alloc("hostAlloc", nbytes)
        self.host_allocs.add(ptr)
        return ptr

    def free(self, ptr: int) -> None:
        self._call("free", ptr)
        self._buffers.pop(ptr)

    def freeHost(self, ptr: int) -> None:
        self._call("freeHost", ptr)
        self._buffers.pop(ptr)
        self.host_allocs.discard(ptr)

    def pointerGetAttributes(self, ptr: int) -> types.SimpleNamespace:
        """Host (type 1) for pinned allocations and registered ranges, else device memory (type 2) of device 0 or
        of the device set in ``pointer_device``."""
        host = any(p <= ptr < p + n for p, n in self.registered.items()) or ptr in self.host_allocs
        device = self.pointer_device.get(ptr, 0)
        return types.SimpleNamespace(devicePointer=ptr, hostPointer=ptr, device=device, type=1 if host else 2)

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        self._call("hostRegister", ptr, nbytes, flags)
        if ptr in self.registered:
            raise FakeCudaError(712)
        self.registered[ptr] = nbytes

    def hostUnregister(self, ptr: int) -> None:
        self._call("hostUnregister", ptr)
        if self.registered.pop(ptr, None) is None:
            raise FakeCudaError(713)

    def streamCreateWithFlags(self, flags: int) -> int:
        self._call("streamCreateWithFlags", flags)
        return next(self._handles)

    def streamDestroy(self, stream: int) -> None:
        self._call("streamDestroy", stream)

    def streamSynchronize(self, stream: int) -> None:
        self._call("streamSynchronize", stream)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._call("streamWaitEvent", stream, event, flags)

    def eventCreateWithFlags(self, flags: int) -> int:
        self._call("eventCreateWithFlags", flags)
        return next(self._handles)

    def eventDestroy(self, event: int) -> None:
        self._call("eventDestroy", event)

    def eventRecord(self, event: int, stream: int) -> None:
        self._call("eventRecord", event, stream)

    def eventQuery(self, event: int) -> int:
        self.calls.append(("eventQuery", event))
        return self.query_status.get(event, 0)

    def eventSynchronize(self, event: int) -> None:
        self._call("eventSynchronize", event)

    def eventElapsedTime(self, start: int, end: int) -> float:
        self._call("eventElapsedTime", start, end)
        return 2.5

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._call("memcpyAsync", dst, src, nbytes, kind, stream)
        ctypes.memmove(dst, src, nbytes)

    def memcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                      stream: int) -> None:
        self._call("memcpy2DAsync", dst, dpitch, src, spitch, width, height, kind, stream)
        assert width <= min(dpitch, spitch)
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


def host_words(ptr: int, count: int, dtype: Any) -> npt.NDArray[Any]:
    raw = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype)


class FakeKernel:
    """Executes the backend's kernels on the host: reads the uploaded descriptor words like the CUDA kernel."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.launches: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]] = []

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 shared_mem: int = 0, stream: Any = None) -> None:
        assert isinstance(stream.ptr, int)
        assert all(isinstance(a, (np.uint64, np.int64)) for a in args)
        self.launches.append((grid, block, args))
        if self.name == "kvoffload_copy_batch":
            src, dst, sizes, count = (int(a) for a in args)
            words = [host_words(p, count, np.int64) for p in (src, dst, sizes)]
            for a, b, n in zip(*(w.tolist() for w in words), strict=True):
                ctypes.memmove(b, a, n)
        else:  # the spin kernel: finishes at once, reporting how
            flag = host_words(int(args[0]), 2, np.int32)
            flag[1] = 1 if flag[0] else 2


class FakeRawModule:
    def __init__(self, code: str) -> None:
        self.code = code
        self.kernels: dict[str, FakeKernel] = {}

    def get_function(self, name: str) -> FakeKernel:
        assert f'extern "C" __global__ void {name}(' in self.code
        return self.kernels.setdefault(name, FakeKernel(name))


class BrokenRawModule(FakeRawModule):
    """Compilation always fails, as without libnvrtc: the backend must fall back to memcpy."""

    def get_function(self, name: str) -> FakeKernel:
        raise RuntimeError("CuPy failed to load libnvrtc.so.12 (fake)")


class FakeDlpackTensor:
    """A tensor that offers only DLPack (like a framework whose dtype has no typestr): host memory posing as
    device memory of ``device``."""

    def __init__(self, host: npt.NDArray[Any], device: tuple[int, int] = (2, 0), *, convertible: bool = True
                 ) -> None:
        self.host, self.device, self.convertible = host, device, convertible
        self.shape, self.dtype = host.shape, host.dtype

    def __dlpack__(self, stream: Any = None) -> object:
        raise AssertionError("the fake cupy.from_dlpack does not call __dlpack__")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def fake_from_dlpack(obj: FakeDlpackTensor) -> FakeDeviceArray:
    if not obj.convertible:
        raise TypeError("dtype not supported (fake)")
    return FakeDeviceArray(obj.host)


class FakeStreamState(threading.local):
    """CuPy's current stream is thread-local: a new thread starts on the legacy default stream (0)."""

    ptr = 0


def fake_cupy(*, compiles: bool = True) -> types.SimpleNamespace:
    runtime = FakeRuntime()
    memory = types.SimpleNamespace(OutOfMemoryError=type("OutOfMemoryError", (MemoryError,), {}))
    current = FakeStreamState()

    def empty(shape: tuple[int, int], dtype: Any) -> FakeDeviceArray:
        return FakeDeviceArray(np.zeros(shape, dtype=dtype))

    return types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, memory=memory, current=current,
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=current.ptr)),
        ndarray=FakeDeviceArray, empty=empty, RawModule=FakeRawModule if compiles else BrokenRawModule,
        ascontiguousarray=lambda a: FakeDeviceArray(np.ascontiguousarray(a.host)), from_dlpack=fake_from_dlpack,
    )


@pytest.fixture
def fake() -> Iterator[tuple[cb.CupyBackend, FakeRuntime]]:
    module = fake_cupy()
    backend = cb.CupyBackend(_cupy_module=module)
    yield backend, module.cuda.runtime
    assert backend.ledger.live() == {}, "test left resources live"


def descriptors(backend: cb.CupyBackend, src: list[int], dst: list[int], sizes: list[int]
                ) -> tuple[DescriptorBuffer, int]:
    buf = backend.alloc_descriptors(len(src))
    count = buf.fill(np.array(src, np.int64), np.array(dst, np.int64), np.array(sizes, np.int64))
    return buf, count


# -- CPU: fake runtime ------------------------------------------------------------------------------------------
def test_fake_backend_conforms_to_protocol(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    assert isinstance(backend, Backend)
    assert backend.name == "cupy"
    assert backend.device_name == "Fake GPU"


def test_fake_query_is_strict(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    event = backend.create_event()
    try:
        assert isinstance(event, cb.CupyEvent)
        backend.record(event, backend.current_stream(), tag=("store", 3))
        assert backend.query(event) is True
        rt.query_status[event.ptr] = 600
        assert backend.query(event) is False
        rt.query_status[event.ptr] = 700
        with pytest.raises(DeviceError, match=r"^event query failed on cuda:0 \(tag store:3\)") as info:
            backend.query(event)
        assert info.value.status == 700
        assert isinstance(info.value.__cause__, FakeCudaError)
    finally:
        backend.destroy_event(event)


@pytest.mark.rule("R16")
@pytest.mark.parametrize(("call", "fails"), [
    (lambda b: b.create_stream(), "streamCreateWithFlags"),
    (lambda b: b.create_event(), "eventCreateWithFlags"),
    (lambda b: b.alloc_descriptors(8), "hostAlloc"),
    (lambda b: b.alloc_descriptors(8), "malloc"),
])
def test_fake_failed_acquire_raises_device_error_and_records_nothing(
        fake: tuple[cb.CupyBackend, FakeRuntime], call: Callable[[cb.CupyBackend], object], fails: str) -> None:
    backend, rt = fake
    rt.fail[fails] = 2
    with pytest.raises(DeviceError) as info:
        call(backend)
    assert info.value.status == 2
    assert isinstance(info.value.__cause__, FakeCudaError)
    assert backend.ledger.acquired() == {}
    assert len(rt._buffers) == 0, "a half-made descriptor block was not freed"


@pytest.mark.rule("R16")
def test_fake_host_register_failure_records_nothing(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    host = np.zeros(8192, np.uint8)
    ptr = host.ctypes.data
    backend.track_host(ptr, host.nbytes)
    backend.host_register(ptr, host.nbytes)
    with pytest.raises(DeviceError) as info:
        backend.host_register(ptr, host.nbytes)
    assert info.value.status == 712
    assert backend.ledger.live() == {"mapping": 1, "pinned": 1}
    rt.fail["hostUnregister"] = 999
    with pytest.raises(DeviceError):
        backend.host_unregister(ptr)
    assert backend.ledger.live() == {"mapping": 1, "pinned": 1}, "a failed unregister stays live"
    del rt.fail["hostUnregister"]
    backend.host_unregister(ptr)
    backend.untrack_host(ptr)


def test_fake_release_calls_never_raise_device_errors(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    stream, event = backend.create_stream(), backend.create_event()
    rt.fail.update(streamDestroy=709, eventDestroy=709)
    backend.destroy_stream(stream)
    backend.destroy_event(event)
    assert backend.ledger.live() == {}
    with pytest.raises(LifecycleError):
        backend.destroy_event(event)
    with pytest.raises(DeviceError) as info:
        backend.record(event, backend.current_stream())
    assert info.value.status == 400
    backend.destroy_stream(backend.current_stream())  # not owned: nothing happens


def test_fake_foreign_handles_are_refused(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    event = backend.create_event()
    try:
        with pytest.raises(InvalidTransferError):
            backend.query(object())
        with pytest.raises(InvalidTransferError):
            backend.wait_event(object(), event)
        foreign = DescriptorBuffer(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), None)
        with pytest.raises(InvalidTransferError):
            backend.copy_batch(backend.current_stream(), foreign, 1)
        with pytest.raises(InvalidTransferError):
            backend.free_descriptors(foreign)
    finally:
        backend.destroy_event(event)


def test_fake_descriptor_buffers_are_exact_pooled_and_balanced(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    frees = rt.count("free")  # the constructor's probe malloc/free
    first = backend.alloc_descriptors(20)
    assert first.capacity == 20
    assert first.src.dtype == first.dst.dtype == first.sizes.dtype == np.int64
    assert first.src.shape == first.dst.shape == first.sizes.shape == (20,)
    backend.free_descriptors(first)
    again = backend.alloc_descriptors(30)  # same power-of-two class (32): reused, no new allocation
    assert rt.count("hostAlloc") == 1
    assert again.src.ctypes.data == first.src.ctypes.data
    with pytest.raises(LifecycleError):
        backend.free_descriptors(first)  # stale: its block was issued again
    backend.free_descriptors(again)
    with pytest.raises(LifecycleError):
        backend.free_descriptors(again)
    assert backend.ledger.acquired() == backend.ledger.released() == {"descriptor": 2}
    assert (rt.count("free") - frees, rt.count("freeHost")) == (0, 0), "frees synchronize the device"
    assert backend.release_cached_memory() == 1
    assert (rt.count("free") - frees, rt.count("freeHost")) == (1, 1)


def test_fake_memcpy_path_coalesces_contiguous_runs_byte_exact(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    page = 64
    dev = backend.from_host(np.arange(16 * page, dtype=np.uint8).reshape(16, page) % 251)
    g = backend.array_info(dev)
    host = np.zeros((16, page), np.uint8)
    backend.track_host(host.ctypes.data, host.nbytes)
    backend.host_register(host.ctypes.data, host.nbytes)  # page-locked: a memcpy never blocks the host (R11)
    backend.copy_path = "memcpy"
    gpu_ids, cpu_ids = [3, 4, 5, 9, 0, 1], [7, 8, 9, 2, 14, 15]  # runs: 3 (3-5 -> 7-9), 1, 2 (0-1 -> 14-15)
    src = [g.ptr + i * g.row_stride for i in gpu_ids]
    dst = [host.ctypes.data + i * page for i in cpu_ids]
    buf, count = descriptors(backend, src, dst, [page] * len(src))
    stream = backend.create_stream()
    try:
        before = rt.count("memcpyAsync")
        backend.copy_batch(stream, buf, count, tag=("store", 1))
        assert rt.count("memcpyAsync") - before == 3
        assert backend.last_copy_path == "memcpy"
        assert np.array_equal(host[cpu_ids], backend.to_host(dev)[gpu_ids])
    finally:
        backend.destroy_stream(stream)
        backend.free_descriptors(buf)
        backend.host_unregister(host.ctypes.data)
        backend.untrack_host(host.ctypes.data)


@pytest.mark.rule("R11")
@pytest.mark.parametrize("copy_path", ["memcpy", "auto"])
def test_fake_copy_batch_refuses_pageable_host_memory_before_any_cuda_call(
        fake: tuple[cb.CupyBackend, FakeRuntime], copy_path: str) -> None:
    """A cudaMemcpyAsync to or from pageable memory blocks the host until the stream reaches it -- under the
    worker's lock, a hung stream would hold shutdown() from another thread (R11): refused, whatever the path."""
    backend, rt = fake
    backend.copy_path = copy_path  # type: ignore[assignment]
    page = 64
    dev = backend.from_host(np.ones((4, page), np.uint8))
    g = backend.array_info(dev)
    host = np.zeros((4, page), np.uint8)
    backend.track_host(host.ctypes.data, host.nbytes)  # mapped (a region), not registered: pageable
    stream = backend.create_stream()
    cases = [([g.ptr], [host.ctypes.data + page], "descriptor 0's destination"),  # a store into pageable rows
             ([g.ptr, host.ctypes.data], [g.ptr + 2 * page, g.ptr + page], "descriptor 1's source")]  # a load
    try:
        for src, dst, what in cases:
            buf, count = descriptors(backend, src, dst, [page] * len(src))
            calls = len(rt.calls)
            with pytest.raises(InvalidTransferError, match=f"{what} .* is pageable host memory .*R11"):
                backend.copy_batch(stream, buf, count, tag=("store", 1))
            assert len(rt.calls) == calls, "refused before any CUDA call"
            backend.free_descriptors(buf)
        backend.host_register(host.ctypes.data, host.nbytes)  # page-locked now: the same copy is queued
        buf, count = descriptors(backend, *cases[0][:2], [page])
        backend.copy_batch(stream, buf, count)
        assert (host[1] == 1).all()
        backend.free_descriptors(buf)
        backend.host_unregister(host.ctypes.data)
    finally:
        backend.destroy_stream(stream)
        backend.untrack_host(host.ctypes.data)


@pytest.mark.parametrize(("count", "capacity", "uploads"), [(3, 4096, 3), (700, 700, 1), (3000, 3000, 1)])
def test_fake_kernel_path_uploads_descriptors_and_launches_once(
        fake: tuple[cb.CupyBackend, FakeRuntime], count: int, capacity: int, uploads: int) -> None:
    """The kernel reads exactly the uploaded words (one upload if small/full, three if sparse) in one launch."""
    backend, rt = fake
    backend.copy_path = "kernel"
    page = 32
    rng = np.random.default_rng(count)
    data = rng.integers(0, 256, (count, page), dtype=np.uint8)
    dev = backend.from_host(data)
    g = backend.array_info(dev)
    host = np.zeros((count, page), np.uint8)
    backend.track_host(host.ctypes.data, host.nbytes)
    backend.host_register(host.ctypes.data, host.nbytes)
    perm = rng.permutation(count)
    buf = backend.alloc_descriptors(capacity)
    n = buf.fill(g.ptr + np.arange(count, dtype=np.int64) * page, host.ctypes.data + perm.astype(np.int64) * page,
                 np.full(count, page, np.int64))
    stream = backend.create_stream()
    try:
        before = rt.count("memcpyAsync")
        backend.copy_batch(stream, buf, n, tag=("store", 7))
        assert backend.last_copy_path == "kernel"
        assert rt.count("memcpyAsync") - before == uploads
        kernel = backend._engine.module.kernels["kvoffload_copy_batch"]
        (grid, block, _args) = kernel.launches[-1]
        assert grid[1] == count and block == (256, 1, 1)
        assert np.array_equal(host[perm], data)
    finally:
        backend.destroy_stream(stream)
        backend.free_descriptors(buf)
        backend.host_unregister(host.ctypes.data)
        backend.untrack_host(host.ctypes.data)


def test_fake_choose_path(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    dev = backend.empty_device((64, 4096))
    g = backend.array_info(dev)
    pinned = np.zeros(64 * 4096, np.uint8)
    unpinned = np.zeros(64 * 4096, np.uint8)
    p_ptr, u_ptr = pinned.ctypes.data, unpinned.ctypes.data
    backend.track_host(p_ptr, pinned.nbytes)
    backend.track_host(u_ptr, unpinned.nbytes)
    # pinned in two adjacent chunks: a copy straddling the boundary is still kernel-legal
    backend.host_register(p_ptr, pinned.nbytes // 2)
    backend.host_register(p_ptr + pinned.nbytes // 2, pinned.nbytes // 2)
    try:
        ids = np.arange(16, dtype=np.int64)
        dev_addrs = g.ptr + ids * 4096
        sizes = np.full(16, 4096, np.int64)
        straddle = p_ptr + pinned.nbytes // 2 - 2048 + ids * 0
        assert backend.choose_path(dev_addrs, p_ptr + ids * 4096, sizes) == "kernel"
        assert backend.choose_path(dev_addrs, straddle, sizes) == "kernel"
        assert backend.choose_path(dev_addrs, u_ptr + ids * 4096, sizes) == "memcpy"       # unpinned host
        assert backend.choose_path(dev_addrs + 64 * 4096, p_ptr + ids * 4096, sizes) == "memcpy"  # unknown
        assert backend.choose_path(dev_addrs[:2], p_ptr + ids[:2] * 4096, sizes[:2]) == "memcpy"  # few
        big = np.full(16, 512 * 1024, np.int64)
        assert backend.choose_path(dev_addrs, p_ptr + ids * 4096, big) == "memcpy"        # large pages
        backend.copy_path = "kernel"
        assert backend.choose_path(dev_addrs[:2], p_ptr + ids[:2] * 4096, sizes[:2]) == "kernel"
        assert backend.choose_path(dev_addrs, u_ptr + ids * 4096, sizes) == "memcpy"       # never illegal
        backend.copy_path = "memcpy"
        assert backend.choose_path(dev_addrs, p_ptr + ids * 4096, sizes) == "memcpy"
    finally:
        backend.host_unregister(p_ptr + pinned.nbytes // 2)
        backend.host_unregister(p_ptr)
        backend.untrack_host(p_ptr)
        backend.untrack_host(u_ptr)
    assert backend.choose_path(dev_addrs, p_ptr + ids * 4096, sizes) == "memcpy"


@given(pinned=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=5),
       device=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=5),
       copies=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 20)), min_size=1, max_size=6))
def test_span_set_contains_all_matches_brute_force(pinned: list[tuple[int, int]], device: list[tuple[int, int]],
                                                   copies: list[tuple[int, int]]) -> None:
    spans = SpanSet()
    covered: set[int] = set()
    for start, length in pinned:
        spans.add_pinned(start, start + length)
    pieces = {start: start + length for start, length in pinned}
    for start, length in device:
        spans.add_device(start, start + length)
        covered.update(range(start, start + length))
    for start, end in pieces.items():
        covered.update(range(start, end))
    addrs = np.array([a for a, _ in copies], np.int64)
    sizes = np.array([n for _, n in copies], np.int64)
    # brute force: every byte inside some interval AND the copy inside ONE merged interval (covered is merged)
    expected = all(all(b in covered for b in range(a, a + n)) and (n > 0 or a in covered or _touches(covered, a))
                   for a, n in copies)
    assert spans.contains_all(addrs, sizes) == expected


@pytest.mark.rule("R11")
@given(registered=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20), st.booleans()), max_size=5),
       device=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=5),
       copies=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 20)), min_size=1, max_size=6))
def test_span_set_first_pageable_matches_brute_force(registered: list[tuple[int, int, bool]],
                                                      device: list[tuple[int, int]],
                                                      copies: list[tuple[int, int]]) -> None:
    """Every registered range is page-locked, kernel-usable or not; a copy is pageable unless it lies inside one
    merged interval of registered and device memory; a discarded registration is pageable again."""
    spans = SpanSet()
    locked: set[int] = set()
    for start, length, kernel in registered:
        spans.add_pinned(start, start + length, kernel=kernel)
    for start, end in {start: start + length for start, length, _ in registered}.items():
        locked.update(range(start, end))
    for start, length in device:
        spans.add_device(start, start + length)
        locked.update(range(start, start + length))
    addrs = np.array([a for a, _ in copies], np.int64)
    sizes = np.array([n for _, n in copies], np.int64)
    expected = next((i for i, (a, n) in enumerate(copies) if not all(b in locked for b in range(a, a + n))), None)
    assert spans.first_pageable(addrs, sizes) == expected
    for start, _, _ in registered:
        spans.discard_pinned(start)
    if not device:
        assert spans.first_pageable(addrs, sizes) == 0


def _touches(covered: set[int], addr: int) -> bool:
    """A zero-size copy at addr counts as inside if addr is inside or at the end of an interval."""
    return addr - 1 in covered


@contextlib.contextmanager
def _two_rows_to_registered_host(backend: cb.CupyBackend) -> Iterator[tuple[npt.NDArray[np.uint8], Any, int]]:
    """Descriptors copying device rows 3 and 1 (filled with 5) to rows 0 and 2 of a registered host array (R11: a
    copy never touches pageable memory); freed, unregistered and untracked afterwards."""
    dev = backend.from_host(np.full((4, 256), 5, np.uint8))
    g = backend.array_info(dev)
    host = np.zeros((4, 256), np.uint8)
    backend.track_host(host.ctypes.data, host.nbytes)
    backend.host_register(host.ctypes.data, host.nbytes)
    buf, count = descriptors(backend, [g.ptr + i * 256 for i in (3, 1)],
                             [host.ctypes.data + i * 256 for i in (0, 2)], [256, 256])
    try:
        yield host, buf, count
    finally:
        backend.free_descriptors(buf)
        backend.host_unregister(host.ctypes.data)
        backend.untrack_host(host.ctypes.data)


def test_fake_kernel_compile_failure_falls_back_to_memcpy(caplog: pytest.LogCaptureFixture) -> None:
    backend = cb.CupyBackend(copy_path="kernel", _cupy_module=fake_cupy(compiles=False))
    assert "copy kernel unavailable" in caplog.text
    with _two_rows_to_registered_host(backend) as (host, buf, count):
        backend.copy_batch(backend.current_stream(), buf, count)
        assert backend.copy_path_counts() == {"kernel": 0, "memcpy": 1}
        assert (host[[0, 2]] == 5).all()
        assert backend.warm_up() is False


@pytest.mark.rule("R11")
def test_fake_kernel_path_only_after_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend built with copy_path="memcpy" never warmed the kernel up: switched to "kernel" later, copy_batch
    still takes the memcpy path, so no submission (under a worker's lock) compiles or loads a module, which may
    synchronize the context (R11); after warm_up() it takes the kernel path."""
    module = fake_cupy()
    compiled: list[str] = []
    monkeypatch.setattr(module, "RawModule", lambda code: compiled.append(code) or FakeRawModule(code))
    backend = cb.CupyBackend(copy_path="memcpy", _cupy_module=module)
    backend.copy_path = "kernel"
    with _two_rows_to_registered_host(backend) as (host, buf, count):
        backend.copy_batch(backend.current_stream(), buf, count)
        assert backend.copy_path_counts() == {"kernel": 0, "memcpy": 1} and compiled == []
        assert backend.warm_up() is True and len(compiled) == 1
        backend.copy_batch(backend.current_stream(), buf, count)
        assert backend.copy_path_counts() == {"kernel": 1, "memcpy": 1} and (host[[0, 2]] == 5).all()


def test_fake_copy_batch_validates_before_device_work(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    buf, count = descriptors(backend, [0, 0], [0, 0], [16, -1])
    try:
        calls = len(rt.calls)
        with pytest.raises(InvalidTransferError):
            backend.copy_batch(backend.current_stream(), buf, count)
        with pytest.raises(InvalidTransferError):
            backend.copy_batch(backend.current_stream(), buf, 3)
        assert len(rt.calls) == calls
        buf.sizes[:] = 0
        backend.copy_batch(backend.current_stream(), buf, count)  # nothing to copy: no submission
        assert rt.count("memcpyAsync") == 0
    finally:
        backend.free_descriptors(buf)


def test_fake_array_info_validation(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    wide = backend.empty_device((8, 300))
    g = backend.array_info(wide[:, :256])  # type: ignore[index]
    assert (g.rows, g.row_bytes, g.row_stride) == (8, 256, 300)
    # any dtype and rank: the first dimension is the block, the rest is the block's bytes
    g = backend.array_info(FakeDeviceArray(np.zeros((2, 3, 5), np.float32)))
    assert (g.rows, g.row_bytes, g.row_stride) == (2, 60, 60)
    assert backend.array_info(FakeDeviceArray(np.zeros(4, np.uint8))).row_bytes == 1
    for bad, why in ((np.zeros((2, 2), np.uint8), r"host memory \(DLPack device type 1\)"),
                     (object(), "expected a GPU tensor"),
                     (FakeDeviceArray(np.zeros((4, 8), np.uint8)[:, ::2]), "not contiguous")):
        with pytest.raises(InvalidTransferError, match=why):
            backend.array_info(bad)
    pinned = np.zeros((4, 64), np.uint8)
    rt.host_allocs.add(pinned.ctypes.data)  # pinned host memory posing as a device array: refused
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[2\]: the memory at 0x[0-9a-f]+ is "
                                                     r"cudaMemoryType 1: expected device or managed memory"):
        backend.array_info(FakeDeviceArray(pinned), index=2)
    for shape in ((2,), (2, -1), (2.0, 3), "2x3"):
        with pytest.raises(InvalidTransferError):
            backend.empty_device(shape)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError):
        backend.from_host(np.zeros((2, 2), np.float32))


@pytest.mark.rule("R7")
def test_fake_array_info_names_the_tensor_on_another_device(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    other = FakeDeviceArray(np.zeros((4, 64), np.uint16))
    rt.pointer_device[other.data.ptr] = 1
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[1\]: is on cuda:1: expected a tensor on the "
                                                     r"backend's device, cuda:0$"):
        backend.array_info(other, index=1)
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[0\]: is on cuda:3"):
        backend.array_info(FakeDlpackTensor(np.zeros((4, 64), np.uint8), (2, 3)), index=0)


def test_fake_array_info_through_dlpack_is_zero_copy(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    host = np.arange(4 * 16 * 2, dtype=np.uint16).reshape(4, 16, 2)
    g = backend.array_info(FakeDlpackTensor(host))
    assert (g.ptr, g.rows, g.row_bytes, g.row_stride) == (host.ctypes.data, 4, 64, 64)
    assert np.array_equal(backend.to_host(FakeDlpackTensor(host)), host.reshape(4, -1).view(np.uint8))


@pytest.mark.rule("R7")
def test_fake_array_info_dlpack_refusals_say_why(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[4\]: cupy.from_dlpack\(.*\) failed .*view"):
        backend.array_info(FakeDlpackTensor(np.zeros((2, 8), np.uint8), convertible=False), index=4)
    with pytest.raises(InvalidTransferError, match=r"pinned|host memory \(DLPack device type 3\)"):
        backend.array_info(FakeDlpackTensor(np.zeros((2, 8), np.uint8), (3, 0)))

    class Raising(FakeDlpackTensor):
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    # the interface raises (as torch does for a tensor that requires grad): DLPack is tried, and the message says
    # both
    with pytest.raises(InvalidTransferError, match=r"requires grad.*TypeError"):
        backend.array_info(Raising(np.zeros((2, 8), np.uint8), convertible=False))


def test_fake_to_host_leaves_out_padding(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    data = np.arange(6 * 40, dtype=np.uint8).reshape(6, 40)
    wide: Any = backend.from_host(data)
    out = backend.to_host(wide[:, :32])
    assert np.array_equal(out, data[:, :32])
    assert rt.count("memcpy2DAsync") == 1


@pytest.mark.rule("R11")
@pytest.mark.rule("R13")
def test_fake_prove_idle_is_bounded_and_strict(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    stream = backend.create_stream()
    assert isinstance(stream, cb.CupyStream)
    real_record = rt.eventRecord
    outcome = {"status": 600}

    def record(event: int, stream_ptr: int) -> None:  # what is recorded on `stream` reports outcome["status"]
        real_record(event, stream_ptr)
        if stream_ptr == stream.ptr:
            rt.query_status[event] = outcome["status"]

    rt.eventRecord = record  # type: ignore[method-assign,assignment]
    try:
        start = backend.monotonic()
        assert backend.prove_idle([stream], start + 0.05) is False
        assert backend.monotonic() - start < 0.05 + 0.1
        assert backend.ledger.live() == {"stream": 1}, "the proof's events were not destroyed"
        outcome["status"] = 0
        assert backend.prove_idle([stream], backend.monotonic() + 1.0) is True
        outcome["status"] = 719
        with pytest.raises(DeviceError) as info:
            backend.prove_idle([stream], backend.monotonic() + 1.0)
        assert info.value.status == 719
    finally:
        backend.destroy_stream(stream)


def test_fake_prove_idle_records_only_on_the_given_streams(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    """The worker passes its compute stream itself: the proof adds no other stream (such as this thread's)."""
    backend, rt = fake
    stream = backend.create_stream()
    compute = backend.compute_stream(0x7000)
    try:
        assert backend.prove_idle([compute, stream], backend.monotonic() + 1.0) is True
        recorded = [c[2] for c in rt.calls if c[0] == "eventRecord"]
        assert recorded == [0x7000, stream.ptr]  # type: ignore[attr-defined]
    finally:
        backend.destroy_stream(stream)


class TorchLikeStream:
    def __init__(self, handle: int, device: int = 0) -> None:
        self.cuda_stream, self.device_index = handle, device


class ProtocolStream:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __cuda_stream__(self) -> Any:
        return self.value


def test_fake_compute_stream_accepts_every_kind(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    for obj in (0x5000, np.int64(0x5000), TorchLikeStream(0x5000), types.SimpleNamespace(ptr=0x5000, device_id=0),
                ProtocolStream((0, 0x5000))):
        handle = backend.compute_stream(obj)
        assert isinstance(handle, cb.CupyStream)
        assert (handle.ptr, handle.owned) == (0x5000, False)
        assert handle is backend.compute_stream(0x5000), "one handle per stream"
    backend.destroy_stream(backend.compute_stream(0x5000))  # not owned: nothing happens
    assert backend.ledger.live() == {}


@pytest.mark.rule("R4")
def test_fake_compute_stream_default_is_captured_once_and_works_from_any_thread(
        fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    """compute_stream(None) is the constructing thread's current stream; another thread's records use that
    stream, not its own current one (a shutdown from another thread proves the right stream idle)."""
    backend, rt = fake
    backend._cp.cuda.current.ptr = 0x6000  # this thread computes on stream 0x6000
    compute = backend.compute_stream()
    event = backend.create_event()
    seen: list[object] = []

    def other_thread() -> None:  # its own current stream is the default stream (0)
        seen.append(backend.current_stream())
        backend.record(event, compute)
        seen.append(backend.prove_idle([compute], backend.monotonic() + 1.0))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    try:
        assert isinstance(compute, cb.CupyStream) and compute.ptr == 0x6000
        assert seen[0].ptr == 0 and seen[1] is True  # type: ignore[attr-defined]
        assert [c[2] for c in rt.calls if c[0] == "eventRecord"] == [0x6000, 0x6000]
    finally:
        backend.destroy_event(event)
        backend._cp.cuda.current.ptr = 0


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("obj", "why"), [
    (object(), r"expected a cudaStream_t int, or an object with __cuda_stream__"),
    (True, "a bool is not a stream"),
    (-1, "negative"),
    (2, "per-thread default stream"),
    (TorchLikeStream(0x5000, device=1), r"stream is on cuda:1: expected a stream on the backend's device, cuda:0"),
    (ProtocolStream((1, 0x5000)), r"unsupported __cuda_stream__ version 1"),
    (ProtocolStream("nope"), r"must give \(version, handle\)"),
    (types.SimpleNamespace(cuda_stream="0x5000"), "expected a cudaStream_t int"),
])
def test_fake_compute_stream_refusals(fake: tuple[cb.CupyBackend, FakeRuntime], obj: object, why: str) -> None:
    backend, rt = fake
    calls = len(rt.calls)
    with pytest.raises(InvalidTransferError, match=r"^compute_stream: .*" + why):
        backend.compute_stream(obj)
    assert len(rt.calls) == calls, "no CUDA call before the refusal"


def test_fake_compute_stream_refuses_a_per_thread_current_stream(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    backend._cp.cuda.current.ptr = 2  # CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1
    try:
        with pytest.raises(InvalidTransferError, match="per-thread default stream"):
            backend.compute_stream()
    finally:
        backend._cp.cuda.current.ptr = 0


def test_fake_spin_helper_plumbing(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    """The GPU tests' spin helper (tests/_cupy_spin.py) against the fake runtime: the fake kernel ends at once,
    reporting 2 (timed out) unless the flag was released first."""
    backend, rt = fake
    spin.warm_spin(backend)
    flag = spin.alloc_spin_flag(backend)
    stream = backend.create_stream()
    try:
        spin.enqueue_spin(backend, stream, flag, timeout=1.0)
        assert flag.state == 2
        flag.release()
        spin.enqueue_spin(backend, stream, flag, timeout=1.0)
        assert flag.state == 1
    finally:
        backend.destroy_stream(stream)
        spin.free_spin_flag(backend, flag)
    with pytest.raises(RuntimeError, match="after free"):
        _ = flag.state
    assert rt.host_allocs == set(), "the flags were not freed"


def test_fake_elapsed_is_seconds(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, _ = fake
    a, b = backend.create_event(), backend.create_event()
    try:
        assert backend.elapsed(a, b) == pytest.approx(0.0025)
    finally:
        backend.destroy_event(a)
        backend.destroy_event(b)


def test_constructor_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="copy_path"):
        cb.CupyBackend(copy_path="fast", _cupy_module=fake_cupy())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernel_min_count"):
        cb.CupyBackend(kernel_min_count=0, _cupy_module=fake_cupy())


def test_missing_device_ordinal_is_a_device_error() -> None:
    with pytest.raises(DeviceError) as info:
        cb.CupyBackend(3, _cupy_module=fake_cupy())
    assert info.value.status == 101


# -- CPU: no CuPy / no GPU --------------------------------------------------------------------------------------
def test_without_cupy_gpu_usable_is_false_and_backend_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    usable, reason = cb.gpu_usable()
    assert usable is False
    assert reason.startswith("CuPy not installed")
    with pytest.raises(ImportError, match="needs CuPy"):
        cb.CupyBackend()


def test_without_gpu_gpu_usable_is_false_and_backend_raises_device_error() -> None:
    cupy = pytest.importorskip("cupy")
    usable, reason = cb.gpu_usable()
    if usable:
        pytest.skip("a GPU is usable here")
    assert "no usable CUDA device" in reason or "no CUDA device" in reason
    with pytest.raises(DeviceError) as info:
        cb.CupyBackend()
    assert info.value.status not in (0, 600)
    assert isinstance(info.value.__cause__, cupy.cuda.runtime.CUDARuntimeError)
    assert info.value.status == info.value.__cause__.status


@pytest.mark.parametrize(("source", "kernel"), [(KERNEL_SOURCE, "kvoffload_copy_batch"),
                                                (spin.SPIN_SOURCE, "kvoffload_spin")])
def test_kernels_compile_with_nvrtc(source: str, kernel: str) -> None:
    """A syntax check of the copy kernel and the test spin kernel with NVRTC, where libnvrtc is installed (no GPU
    needed)."""
    cupy = pytest.importorskip("cupy")
    nvrtc = cupy.cuda.nvrtc  # cupy_backends.cuda.libs.nvrtc: the raw bindings (no driver needed)
    try:
        nvrtc.getVersion()
    except Exception as exc:  # libnvrtc not installed
        pytest.skip(f"NVRTC unavailable: {exc}")
    prog = nvrtc.createProgram(source, "kvoffload_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_90"])
        except Exception:
            pytest.fail(f"NVRTC rejected the source of {kernel}:\n{nvrtc.getProgramLog(prog)}")
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = ptx.decode(errors="replace") if isinstance(ptx, bytes) else str(ptx)
    assert kernel in text


# ---------------------------------------------------------------------------------------------------------------
# Real GPU
# ---------------------------------------------------------------------------------------------------------------
DEADLINE = 30.0  # seconds: generous bound for work that must complete


@pytest.fixture(scope="module")
def gpu_backend() -> Iterator[cb.CupyBackend]:
    backend = cb.CupyBackend(0)  # compiles, loads and launches the copy kernel once (warm_up)
    if backend.kernel_unavailable is None:  # else the kernel tests fail, saying why; the others still run
        spin.warm_spin(backend)
    yield backend
    backend.release_cached_memory()


@pytest.fixture
def gpu(gpu_backend: cb.CupyBackend) -> Iterator[cb.CupyBackend]:
    """The shared GPU backend; checks the ledger is back where it was and restores the copy path."""
    live = gpu_backend.ledger.live()
    yield gpu_backend
    gpu_backend.copy_path = "auto"
    assert gpu_backend.ledger.live() == live, "test left resources live"


class HostRegion:
    """An anonymous mmap, tracked (and optionally registered) through the backend, as the real region does."""

    def __init__(self, backend: cb.CupyBackend, rows: int, row_bytes: int, *, pin: bool = True) -> None:
        self.backend, self.pinned = backend, pin
        self.mm = mmap.mmap(-1, rows * row_bytes)
        self.rows: U8 | None = np.frombuffer(self.mm, np.uint8).reshape(rows, row_bytes)
        self.ptr = int(self.rows.ctypes.data)
        self.row_bytes = row_bytes
        backend.track_host(self.ptr, rows * row_bytes)
        if pin:
            backend.host_register(self.ptr, rows * row_bytes)

    def view(self) -> U8:
        assert self.rows is not None
        return self.rows

    def close(self) -> None:
        if self.pinned:
            self.backend.host_unregister(self.ptr)
        self.backend.untrack_host(self.ptr)
        self.rows = None
        with contextlib.suppress(BufferError):  # a view still alive: the mmap closes when it is collected
            self.mm.close()


@contextlib.contextmanager
def region(backend: cb.CupyBackend, rows: int, row_bytes: int, *, pin: bool = True) -> Iterator[HostRegion]:
    r = HostRegion(backend, rows, row_bytes, pin=pin)
    try:
        yield r
    finally:
        r.close()


def run_copy(backend: cb.CupyBackend, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
             sizes: npt.NDArray[np.int64], tag: tuple[str, int]) -> str:
    """One transfer as the handler does it (fresh stream, waits for the compute stream, end event), waited for
    with a bounded poll. Returns the path it took."""
    stream, marker, end = backend.create_stream(), backend.create_event(), backend.create_event()
    buf = backend.alloc_descriptors(int(src.shape[0]))
    try:
        count = buf.fill(src, dst, sizes)
        backend.record(marker, backend.current_stream())
        backend.wait_event(stream, marker)
        backend.copy_batch(stream, buf, count, tag=tag)
        backend.record(end, stream, tag=tag)
        assert poll_until(backend, lambda: backend.query(end), backend.monotonic() + DEADLINE)
        return str(backend.last_copy_path)
    finally:
        backend.free_descriptors(buf)
        backend.destroy_event(marker)
        backend.destroy_event(end)
        backend.destroy_stream(stream)


@pytest.mark.gpu
def test_gpu_usable_and_protocol(gpu: cb.CupyBackend) -> None:
    usable, reason = cb.gpu_usable()
    assert usable, reason
    assert isinstance(gpu, Backend)
    assert gpu.sm_count > 0
    assert gpu.kernel_unavailable is None, gpu.kernel_unavailable


@pytest.mark.gpu
@pytest.mark.parametrize("page", [4096, 65536])
@pytest.mark.parametrize("path", ["kernel", "memcpy"])
def test_gpu_round_trip_store_then_load(gpu: cb.CupyBackend, page: int, path: cb.CopyPath) -> None:
    assert path == "memcpy" or gpu.kernel_unavailable is None, gpu.kernel_unavailable
    gpu.copy_path = path
    rng = np.random.default_rng(page)
    n_gpu, n_cpu, n = 32, 48, 24
    data = rng.integers(0, 256, (n_gpu, page), dtype=np.uint8)
    dev = gpu.from_host(data)
    g = gpu.array_info(dev)
    gpu_ids = rng.permutation(n_gpu)[:n].astype(np.int64)
    cpu_ids = rng.permutation(n_cpu)[:n].astype(np.int64)
    sizes = np.full(n, page, np.int64)
    with region(gpu, n_cpu, page) as host:
        took = run_copy(gpu, g.ptr + gpu_ids * g.row_stride, host.ptr + cpu_ids * page, sizes, ("store", 1))
        assert took == path
        assert np.array_equal(host.view()[cpu_ids], data[gpu_ids])
        back = gpu.from_host(np.zeros((n_gpu, page), np.uint8))
        gb = gpu.array_info(back)
        load_ids = rng.permutation(n_gpu)[:n].astype(np.int64)
        took = run_copy(gpu, host.ptr + cpu_ids * page, gb.ptr + load_ids * gb.row_stride, sizes, ("load", 2))
        assert took == path
        result = gpu.to_host(back)
        assert np.array_equal(result[load_ids], data[gpu_ids])
        untouched = np.setdiff1d(np.arange(n_gpu), load_ids)
        assert not result[untouched].any()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "memcpy"])
def test_gpu_padded_rows_and_unaligned_descriptors(gpu: cb.CupyBackend, path: cb.CopyPath) -> None:
    """Row stride > row bytes, and sizes/offsets that are not multiples of 16 (the kernel's 8/4/1-byte paths)."""
    assert path == "memcpy" or gpu.kernel_unavailable is None, gpu.kernel_unavailable
    gpu.copy_path = path
    rng = np.random.default_rng(7)
    wide = gpu.from_host(rng.integers(0, 256, (16, 4096 + 512), dtype=np.uint8))
    dev: Any = wide
    view = dev[:, :4096]
    g = gpu.array_info(view)
    assert (g.row_bytes, g.row_stride) == (4096, 4096 + 512)
    expect = gpu.to_host(view)
    with region(gpu, 16, 4096) as host:
        for shift, size in ((0, 4096), (8, 4000), (4, 4092), (3, 4093), (1, 17)):
            host.view()[:] = 0
            ids = np.arange(0, 16, 2, dtype=np.int64)
            src = g.ptr + ids * g.row_stride + shift
            dst = host.ptr + ids * 4096 + shift
            took = run_copy(gpu, src, dst, np.full(ids.shape, size, np.int64), ("store", shift))
            assert took == path
            got = host.view()[ids]
            assert np.array_equal(got[:, shift:shift + size], expect[ids, shift:shift + size]), (shift, size)
            assert not got[:, :shift].any() and not got[:, shift + size:].any()


@pytest.mark.gpu
@pytest.mark.rule("R11")
def test_gpu_unpinned_host_memory_is_refused_on_every_path(gpu: cb.CupyBackend) -> None:
    """Never the kernel path (it cannot dereference unregistered memory), and never a cudaMemcpyAsync either (to
    pageable memory it blocks the host, R11): refused before any CUDA call."""
    gpu.copy_path = "kernel"
    data = np.random.default_rng(3).integers(0, 256, (16, 4096), dtype=np.uint8)
    dev = gpu.from_host(data)
    g = gpu.array_info(dev)
    ids = np.arange(16, dtype=np.int64)[::-1].copy()
    with region(gpu, 16, 4096, pin=False) as host:
        with pytest.raises(InvalidTransferError, match="pageable host memory"):
            run_copy(gpu, g.ptr + ids * 4096, host.ptr + np.arange(16) * 4096, np.full(16, 4096, np.int64),
                     ("store", 5))
        assert not host.view().any()


@pytest.mark.gpu
def test_gpu_descriptor_buffers_are_pinned(gpu: cb.CupyBackend) -> None:
    rt = importlib.import_module("cupy").cuda.runtime
    buf = gpu.alloc_descriptors(100)
    try:
        assert buf.capacity == 100
        for arr in (buf.src, buf.dst, buf.sizes):
            assert int(rt.pointerGetAttributes(arr.ctypes.data).type) == int(rt.memoryTypeHost)
    finally:
        gpu.free_descriptors(buf)


@contextlib.contextmanager
def resources(backend: cb.CupyBackend) -> Iterator[contextlib.ExitStack]:
    """An ExitStack for streams, events and descriptor buffers, released in reverse order even if a test fails."""
    with contextlib.ExitStack() as stack:
        yield stack


def new_stream(backend: cb.CupyBackend, stack: contextlib.ExitStack) -> Any:
    stream = backend.create_stream()
    stack.callback(backend.destroy_stream, stream)
    return stream


def new_event(backend: cb.CupyBackend, stack: contextlib.ExitStack) -> Any:
    event = backend.create_event()
    stack.callback(backend.destroy_event, event)
    return event


def new_descriptors(backend: cb.CupyBackend, stack: contextlib.ExitStack, capacity: int) -> DescriptorBuffer:
    buf = backend.alloc_descriptors(capacity)
    stack.callback(backend.free_descriptors, buf)
    return buf


@contextlib.contextmanager
def spin_flag(backend: cb.CupyBackend, done: Any) -> Iterator[spin.SpinFlag]:
    """A spin flag that is always released on exit; it is freed only once ``done`` (an event recorded after the
    spin) has completed, else leaked on purpose (freeing it under a running kernel would be an illegal access)."""
    flag = spin.alloc_spin_flag(backend)
    try:
        yield flag
    finally:
        flag.release()
        if poll_until(backend, lambda: backend.query(done), backend.monotonic() + DEADLINE):
            spin.free_spin_flag(backend, flag)


@pytest.mark.gpu
@pytest.mark.rule("R4")
def test_gpu_copy_waits_for_the_compute_stream(gpu: cb.CupyBackend) -> None:
    """A spin kernel holds the compute stream; a write queued behind it must be what the transfer copies."""
    n, page = 16, 4096
    dev: Any = gpu.from_host(np.ones((n, page), np.uint8))
    g = gpu.array_info(dev)
    dev.fill(1)  # loads CuPy's fill kernel now: no module may load while the spin runs
    gpu.to_host(dev)
    ids = np.arange(n, dtype=np.int64)
    sizes = np.full(n, page, np.int64)
    with region(gpu, n, page) as waited, region(gpu, n, page) as control, resources(gpu) as stack:
        xfer, other = new_stream(gpu, stack), new_stream(gpu, stack)
        marker, end, early = (new_event(gpu, stack) for _ in range(3))
        buf, buf2 = new_descriptors(gpu, stack, n), new_descriptors(gpu, stack, n)
        buf.fill(g.ptr + ids * page, waited.ptr + ids * page, sizes)
        buf2.fill(g.ptr + ids * page, control.ptr + ids * page, sizes)
        compute = gpu.current_stream()
        with spin_flag(gpu, end) as flag:
            spin.enqueue_spin(gpu, compute, flag, timeout=20.0)
            dev.fill(7)  # CuPy's current stream is the compute stream: queued behind the spin
            gpu.record(marker, compute)
            gpu.wait_event(xfer, marker)
            gpu.copy_batch(xfer, buf, n, tag=("store", 1))
            gpu.record(end, xfer, tag=("store", 1))
            # control: the same copy without the wait runs at once and sees the old data
            gpu.copy_batch(other, buf2, n, tag=("store", 2))
            gpu.record(early, other, tag=("store", 2))
            assert poll_until(gpu, lambda: gpu.query(early), gpu.monotonic() + DEADLINE)
            assert (control.view() == 1).all(), "the spin did not hold the compute stream"
            assert gpu.query(end) is False
            flag.release()
            assert poll_until(gpu, lambda: gpu.query(end), gpu.monotonic() + DEADLINE)
            assert flag.state == 1, "the spin kernel timed out instead of being released"
        assert (waited.view() == 7).all()


@pytest.mark.gpu
@pytest.mark.rule("R11")
@pytest.mark.rule("R13")
def test_gpu_never_completing_transfer_bounded_wait_and_proof(gpu: cb.CupyBackend) -> None:
    with resources(gpu) as stack:
        stream, end = new_stream(gpu, stack), new_event(gpu, stack)
        events_before = gpu.ledger.live().get("event", 0)
        with spin_flag(gpu, end) as flag:
            spin.enqueue_spin(gpu, stream, flag, timeout=20.0)
            gpu.record(end, stream, tag=("store", 9))
            start = gpu.monotonic()
            assert poll_until(gpu, lambda: gpu.query(end), start + 0.2) is False
            assert 0.2 <= gpu.monotonic() - start < 0.2 + 0.25
            start = gpu.monotonic()
            assert gpu.prove_idle([stream], start + 0.2) is False
            assert gpu.monotonic() - start < 0.2 + 0.25
            assert gpu.ledger.live().get("event", 0) == events_before, "prove_idle leaked its events"
            flag.release()
            assert gpu.prove_idle([stream], gpu.monotonic() + DEADLINE) is True
            assert gpu.query(end) is True
            assert flag.state == 1, "the spin kernel timed out instead of being released"


class _RuntimeProxy:
    """The real runtime, except for the functions given."""

    def __init__(self, real: Any, **overrides: Callable[..., Any]) -> None:
        self._real, self._overrides = real, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides.get(name) or getattr(self._real, name)


@pytest.mark.gpu
def test_gpu_query_error_is_a_device_error_not_pending() -> None:
    """A real event whose query reports 700 (simulated: a real illegal address would kill the context)."""
    cupy = importlib.import_module("cupy")
    rt = _RuntimeProxy(cupy.cuda.runtime, eventQuery=lambda ptr: 700)
    module = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=rt, get_current_stream=cupy.cuda.get_current_stream, memory=cupy.cuda.memory,
        driver=cupy.cuda.driver), ndarray=cupy.ndarray, empty=cupy.empty, RawModule=cupy.RawModule,
        ascontiguousarray=cupy.ascontiguousarray)
    backend = cb.CupyBackend(0, _cupy_module=module)
    event = backend.create_event()
    try:
        backend.record(event, backend.current_stream(), tag=("load", 4))
        with pytest.raises(DeviceError) as info:
            backend.query(event)
        assert info.value.status == 700
        assert isinstance(info.value.__cause__, cupy.cuda.runtime.CUDARuntimeError)
    finally:
        backend.destroy_event(event)
    assert backend.ledger.live() == {}


@pytest.mark.gpu
@pytest.mark.rule("R16")
def test_gpu_real_errors_map_and_ledger_balances(gpu: cb.CupyBackend) -> None:
    cupy = importlib.import_module("cupy")
    with region(gpu, 4, 4096) as host:
        with pytest.raises(DeviceError) as info:
            gpu.host_register(host.ptr, 4 * 4096)  # already registered
        assert info.value.status in (1, 712)  # cudaErrorHostMemoryAlreadyRegistered (or InvalidValue)
        assert isinstance(info.value.__cause__, cupy.cuda.runtime.CUDARuntimeError)
        assert info.value.status == info.value.__cause__.status
        assert gpu.ledger.state_of("pinned", host.ptr) == "live"
    with region(gpu, 4, 4096, pin=False) as host, pytest.raises(DeviceError) as info:
        gpu.host_unregister(host.ptr)  # never registered
    assert info.value.status in (1, 713)  # cudaErrorHostMemoryNotRegistered (or InvalidValue)
    acquired, released = gpu.ledger.acquired(), gpu.ledger.released()
    with resources(gpu) as stack:
        streams = [new_stream(gpu, stack) for _ in range(3)]
        events = [new_event(gpu, stack) for _ in range(3)]
        for c in (1, 64, 5000):
            new_descriptors(gpu, stack, c)
        for s, e in zip(streams, events, strict=True):
            gpu.record(e, s)
            gpu.synchronize(e)
            assert gpu.query(e)
        assert gpu.ledger.live().get("stream", 0) >= 3
    delta_acquired = {k: v - acquired.get(k, 0) for k, v in gpu.ledger.acquired().items()}
    delta_released = {k: v - released.get(k, 0) for k, v in gpu.ledger.released().items()}
    assert delta_acquired == delta_released
    assert {k: delta_acquired[k] for k in ("stream", "event", "descriptor")} == \
        {"stream": 3, "event": 3, "descriptor": 3}


@pytest.mark.gpu
def test_gpu_elapsed_times_a_transfer(gpu: cb.CupyBackend) -> None:
    page, n = 65536, 256
    dev = gpu.empty_device((n, page))
    g = gpu.array_info(dev)
    ids = np.random.default_rng(1).permutation(n).astype(np.int64)
    with region(gpu, n, page) as host:
        stream, start, end = gpu.create_stream(), gpu.create_event(), gpu.create_event()
        buf = gpu.alloc_descriptors(n)
        count = buf.fill(g.ptr + ids * page, host.ptr + np.arange(n) * page, np.full(n, page, np.int64))
        gpu.record(start, stream)
        gpu.copy_batch(stream, buf, count, tag=("store", 1))
        gpu.record(end, stream)
        assert poll_until(gpu, lambda: gpu.query(end), gpu.monotonic() + DEADLINE)
        seconds = gpu.elapsed(start, end)
        assert 0.0 < seconds < 1.0
        for e in (start, end):
            gpu.destroy_event(e)
        gpu.destroy_stream(stream)
        gpu.free_descriptors(buf)


# -- the worker on the real GPU (integration with handler, region and worker) ------------------------------------
def _worker_setup(backend: cb.CupyBackend) -> tuple[Any, Any, list[U8], list[Any]]:
    kv = importlib.import_module("kvoffload_ref")
    layout = kv.KVCacheLayout(tensor_page_bytes=(4096, 4096),
                              groups=((kv.LayerRef(0, 4096), kv.LayerRef(1, 4096)),))
    rng = np.random.default_rng(11)
    data = [rng.integers(0, 256, (64, 4096), dtype=np.uint8) for _ in range(2)]
    return kv, layout, data, [backend.from_host(d) for d in data]


@pytest.mark.gpu
@pytest.mark.rule("R3")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("pinning", ["register", "alloc"])
def test_gpu_worker_round_trip(pinning: str) -> None:
    """A store and a load back, byte-exact, over a registered region and over a pinned allocation (the fallback
    where registration is refused): released in R3's order, the ledger balanced."""
    backend = cb.CupyBackend(0)
    kv, layout, data, gpu = _worker_setup(backend)
    with kv.create_worker(backend, gpu, layout, blocks_per_chunk=2, num_cpu_chunks=16, pinning=pinning,
                          policy=kv.ShutdownPolicy(timeout=5.0, on_unproven="quarantine")) as w:
        assert w.stats().pinning == ("allocated" if pinning == "alloc" else "registered")
        assert w.submit_store(1, kv.GPULoadStoreSpec([5, 9, 1, 3], group_sizes=(4,), block_indices=(0,)),
                              kv.CPULoadStoreSpec([10, 7]))
        w.wait({1}, timeout=DEADLINE)
        w.submit_load(2, kv.CPULoadStoreSpec([10, 7]), kv.GPULoadStoreSpec([20, 21, 22, 23], (4,), (0,)))
        w.wait({2}, timeout=DEADLINE)
        results = w.get_finished()
    report = w.shutdown()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    for t in range(2):
        assert np.array_equal(backend.to_host(gpu[t])[[20, 21, 22, 23]], data[t][[5, 9, 1, 3]])
    assert (report.region, report.device_sync) == ("released", "not_needed")
    assert backend.ledger.live() == {}
    if pinning == "alloc":
        assert report.pinning == "allocated" and backend.ledger.released().get("pinned_alloc") == 1
    backend.release_cached_memory()


@pytest.mark.gpu
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
def test_gpu_worker_shutdown_is_bounded_while_the_compute_stream_hangs() -> None:
    """A store waits on a compute stream that never finishes: shutdown returns in time and quarantines."""
    backend = cb.CupyBackend(0)
    assert backend.kernel_unavailable is None, backend.kernel_unavailable
    spin.warm_spin(backend)
    kv, layout, _data, gpu = _worker_setup(backend)
    w = kv.create_worker(backend, gpu, layout, blocks_per_chunk=2, num_cpu_chunks=16,
                         policy=kv.ShutdownPolicy(timeout=0.5, on_unproven="quarantine"))
    spin_done = backend.create_event()
    with spin_flag(backend, spin_done) as flag:
        spin.enqueue_spin(backend, backend.current_stream(), flag, timeout=20.0)
        backend.record(spin_done, backend.current_stream())
        assert w.submit_store(1, kv.GPULoadStoreSpec([5, 9], group_sizes=(2,), block_indices=(0,)),
                              kv.CPULoadStoreSpec([3]))
        start = backend.monotonic()
        report = w.shutdown()
        took = backend.monotonic() - start
        assert took < 0.5 + 1.0, f"shutdown took {took:.2f} s"
        spin.assert_quarantined_while_spinning(backend, report, flag, spin_done, DEADLINE)
    backend.destroy_event(spin_done)
    assert backend.ledger.live() == {}, "only quarantined resources may remain"


@pytest.mark.gpu
@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("create", ["create_worker", "create_reference_worker"])
def test_gpu_cancel_retires_a_stuck_stream_and_new_work_runs_on_a_fresh_one(create: str) -> None:
    """A spin kernel wedges the store direction's stream (as a hung copy would): the store behind it is cancelled,
    its blocks are held, a new store runs on a fresh stream with the right bytes, and once the spin ends the late
    copy is observed done and its hold handed out once (scripts/gpu_check.sh runs it)."""
    backend = cb.CupyBackend(0)
    assert backend.kernel_unavailable is None, backend.kernel_unavailable
    spin.warm_spin(backend)
    kv, layout, data, gpu = _worker_setup(backend)
    w = getattr(kv, create)(backend, gpu, layout, blocks_per_chunk=2, num_cpu_chunks=16,
                            policy=kv.ShutdownPolicy(timeout=5.0, on_unproven="quarantine"))
    handler = w._core.store
    stuck = getattr(handler, "stream", None) or handler._stream  # the direction's current stream (test only)
    spin_done = backend.create_event()
    with spin_flag(backend, spin_done) as flag:
        spin.enqueue_spin(backend, stuck, flag, timeout=20.0)
        backend.record(spin_done, stuck)
        w.submit_store(1, kv.GPULoadStoreSpec([5, 9], group_sizes=(2,), block_indices=(0,)), kv.CPULoadStoreSpec([3]))
        w.cancel([1])
        (late,) = w.get_finished()
        assert isinstance(late.error, kv.TransferExpired) and late.error.reason == "cancel"
        assert w.held().cpu_chunks == (3,)
        with pytest.raises(kv.BlocksHeldError):
            w.submit_store(2, kv.GPULoadStoreSpec([1, 2], (2,), (0,)), kv.CPULoadStoreSpec([3]))
        w.submit_store(2, kv.GPULoadStoreSpec([1, 2], (2,), (0,)), kv.CPULoadStoreSpec([4]))
        w.wait({2}, timeout=DEADLINE)  # a fresh stream: not behind the spin
        (ok,) = w.get_finished()
        assert ok.success
        snap = w.cpu_snapshot()
        assert all(np.array_equal(snap[t][4], data[t][[1, 2]].reshape(-1)) for t in range(2))
        assert w.take_released() == []
    assert poll_until(backend, lambda: backend.query(spin_done), backend.monotonic() + DEADLINE)
    assert poll_until(backend, lambda: bool(w.get_finished() or True) and not w.held().cpu_chunks,
                      backend.monotonic() + DEADLINE)
    assert [(r.job_id, r.cpu_chunks) for r in w.take_released()] == [(1, (3,))]
    report = w.shutdown()
    assert (report.region, report.store.retired_streams) == ("released", 0)
    backend.destroy_event(spin_done)
    assert backend.ledger.live() == {}
    backend.release_cached_memory()


# ---------------------------------------------------------------------------------------------------------------
# R25: the memcpy path never merges a run across a registration seam (appended with issue 19, part 5)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.rule("R25")
def test_fake_memcpy_path_splits_a_merged_run_at_a_registration_seam(fake: tuple[cb.CupyBackend,
                                                                                  FakeRuntime]) -> None:
    backend, rt = fake
    page = 64
    data = (np.arange(16 * page, dtype=np.uint8).reshape(16, page) * 7) % 251
    dev, back = backend.from_host(data), backend.from_host(np.zeros((16, page), np.uint8))
    g, gb = backend.array_info(dev), backend.array_info(back)
    host = np.zeros((16, page), np.uint8)
    hp = host.ctypes.data
    backend.track_host(hp, host.nbytes)
    backend.host_register(hp, 6 * page)             # rows 0..5
    backend.host_register(hp + 6 * page, 10 * page)  # rows 6..15: the seam is at row 6
    backend.copy_path = "memcpy"
    rows = list(range(2, 12))  # one run on both sides, over the seam
    stream = backend.create_stream()
    store, n_store = descriptors(backend, [g.ptr + i * g.row_stride for i in rows], [hp + i * page for i in rows],
                                 [page] * len(rows))
    load, n_load = descriptors(backend, [hp + i * page for i in rows], [gb.ptr + i * gb.row_stride for i in rows],
                               [page] * len(rows))
    try:
        before = len(rt.calls)
        backend.copy_batch(stream, store, n_store, tag=("store", 1))  # the seam on the destination side
        backend.copy_batch(stream, load, n_load, tag=("load", 2))     # and on the source side
        runs = [(c[1], c[2], c[3]) for c in rt.calls[before:] if c[0] == "memcpyAsync"]
        assert runs == [(hp + 2 * page, g.ptr + 2 * page, 4 * page), (hp + 6 * page, g.ptr + 6 * page, 6 * page),
                        (gb.ptr + 2 * page, hp + 2 * page, 4 * page), (gb.ptr + 6 * page, hp + 6 * page, 6 * page)]
        assert np.array_equal(host[rows], data[rows]) and not host[[0, 1, 12, 13, 14, 15]].any()
        assert np.array_equal(backend.to_host(back)[rows], data[rows])
        backend.host_unregister(hp + 6 * page)
        backend.host_unregister(hp)
        backend.host_register(hp, 16 * page)  # one registration: no seam inside, one run again
        before = len(rt.calls)
        backend.copy_batch(stream, store, n_store, tag=("store", 3))
        assert [c[3] for c in rt.calls[before:] if c[0] == "memcpyAsync"] == [10 * page]
        backend.host_unregister(hp)
    finally:
        backend.destroy_stream(stream)
        backend.free_descriptors(store)
        backend.free_descriptors(load)
        backend.untrack_host(hp)


@pytest.mark.rule("R25")
def test_coalesce_breaks_runs_only_at_seams_and_discontinuities() -> None:
    from kvoffload_ref.backends._cupy_copy import coalesce, registration_seams

    src = np.array([0, 10, 20, 30, 100, 110], np.int64)
    dst = np.array([1000, 1010, 1020, 1030, 1040, 1050], np.int64)
    sizes = np.full(6, 10, np.int64)
    seams = registration_seams([(1000, 1020), (1020, 1520)])   # a seam at dst 1020 (and bounds at 1000, 1520)
    assert seams.tolist() == [1000, 1020, 1520]
    runs = coalesce(src, dst, sizes, seams)
    assert [r.tolist() for r in runs] == [[0, 20, 100], [1000, 1020, 1040], [20, 20, 20]]
    assert [r.tolist() for r in coalesce(src, dst, sizes)] == [[0, 100], [1000, 1040], [40, 20]]
    assert [r.tolist() for r in coalesce(src, dst, sizes, registration_seams(()))] == [[0, 100], [1000, 1040],
                                                                                        [40, 20]]


@pytest.mark.gpu
@pytest.mark.rule("R25")
@pytest.mark.parametrize("path", ["memcpy", "kernel"])
def test_gpu_seam_crossing_plan_is_split_by_the_memcpy_path_byte_exact(gpu: cb.CupyBackend,
                                                                       path: cb.CopyPath) -> None:
    """A region registered in 4-row chunks; a store and a load of 16 contiguous rows (one run on both sides,
    over three seams): the memcpy path splits the run at each seam (four cudaMemcpyAsync, none spanning two
    registrations), the kernel path may cross them; either way the bytes are exact."""
    import kvoffload_ref as kv
    from kvoffload_ref.backends._cupy_copy import coalesce

    assert path == "memcpy" or gpu.kernel_unavailable is None, gpu.kernel_unavailable
    gpu.copy_path = path
    page, rows = 4096, 16
    layout = kv.KVCacheLayout(tensor_page_bytes=(page,), groups=((kv.LayerRef(0, page),),))
    region = kv.HostRegion.allocate(gpu, layout, 1, rows, max_register_bytes=4 * page)
    region.pin()
    try:
        assert region.pinned_ranges == 4
        data = np.random.default_rng(25).integers(0, 256, (rows, page), dtype=np.uint8)
        dev, back = gpu.from_host(data), gpu.from_host(np.zeros((rows, page), np.uint8))
        g, gb = gpu.array_info(dev), gpu.array_info(back)
        (c,) = region.geometries()
        ids = np.arange(rows, dtype=np.int64)
        sizes = np.full(rows, page, np.int64)
        cpu = c.ptr + ids * c.row_stride
        assert g.row_stride == page and c.row_stride == page, "one run on both sides"
        split = coalesce(g.ptr + ids * page, cpu, sizes, gpu._spans.seams)
        assert split[2].tolist() == [4 * page] * 4, "split at each seam"
        assert run_copy(gpu, g.ptr + ids * g.row_stride, cpu, sizes, ("store", 1)) == path
        (stored,) = region.snapshot()
        assert np.array_equal(stored, data)
        assert run_copy(gpu, cpu, gb.ptr + ids * gb.row_stride, sizes, ("load", 2)) == path
        assert np.array_equal(gpu.to_host(back), data)
    finally:
        region.release()


# -- pinned allocation where registration is refused (vLLM #55428) --------------------------------------------------


def test_fake_host_register_801_is_the_typed_refusal_and_records_nothing(
        fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    host = np.zeros(8192, np.uint8)
    ptr = host.ctypes.data
    backend.track_host(ptr, host.nbytes)
    rt.fail["hostRegister"] = 801  # cudaErrorNotSupported, for every size and flag
    assert not backend.refuses_registration
    with pytest.raises(RegistrationRefused) as info:
        backend.host_register(ptr, host.nbytes)
    assert info.value.status == 801 and backend.refuses_registration
    rt.fail["hostRegister"] = 1  # any other status stays an ordinary DeviceError
    with pytest.raises(DeviceError) as other:
        backend.host_register(ptr, 4096)
    assert type(other.value) is DeviceError and other.value.status == 1
    assert backend.ledger.live() == {"mapping": 1}
    backend.untrack_host(ptr)


def test_fake_alloc_pinned_calls_host_alloc_directly_and_free_pinned_frees_it(
        fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    ptr, buffer = backend.alloc_pinned(8192)
    assert [c for c in rt.calls if c[0] == "hostAlloc"] == [("hostAlloc", 8192)] and ptr in rt.host_allocs
    assert buffer.size == 8192 and int(buffer.ctypes.data) == ptr and not buffer.any()
    assert backend.ledger.live() == {"pinned_alloc": 1} and rt.count("hostRegister") == 0
    dev = backend.from_host(np.arange(2 * 4096, dtype=np.uint64).astype(np.uint8).reshape(2, 4096))
    buf, count = descriptors(backend, [backend.array_info(dev).ptr], [ptr], [8192])  # pinned: no pageable refusal
    stream = backend.create_stream()
    backend.copy_batch(stream, buf, count)
    assert np.array_equal(buffer, backend.to_host(dev).reshape(-1))
    backend.free_descriptors(buf)
    backend.destroy_stream(stream)
    with pytest.raises(LifecycleError):
        backend.free_pinned(ptr + 1)
    rt.fail["freeHost"] = 999
    with pytest.raises(DeviceError):
        backend.free_pinned(ptr)
    assert backend.ledger.live() == {"pinned_alloc": 1}, "a failed free stays live"
    del rt.fail["freeHost"]
    backend.free_pinned(ptr)
    assert ptr not in rt.host_allocs


def test_fake_alloc_pinned_checks_its_size(fake: tuple[cb.CupyBackend, FakeRuntime]) -> None:
    backend, rt = fake
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidTransferError):
            backend.alloc_pinned(bad)  # type: ignore[arg-type]
    assert rt.count("hostAlloc") == 0


