"""Pinned memory allocated directly (``backends/pinned.py``) on the simulated device, a platform that refuses host
registration (``SimBackend(host_register="refuse")``, vLLM #55428), and the module's defaults for a backend without
``alloc_pinned``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends import pinned
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Stream, Tag
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import (
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_NOT_SUPPORTED,
    DeviceError,
    InvalidTransferError,
    RegistrationRefused,
)

PAGE = 4096
LATENCY = 5e-6
PINNED_BW = 25e9
PAGEABLE_BW = 8e9
TAG: Tag = ("store", 1)


def _sim(**kwargs: Any) -> SimBackend:
    return SimBackend(latency=LATENCY, pinned_bandwidth=PINNED_BW, pageable_bandwidth=PAGEABLE_BW, **kwargs)


def _copy(be: SimBackend, stream: Stream, pairs: Sequence[tuple[int, int]], size: int = PAGE,
          tag: Tag = TAG) -> DescriptorBuffer:
    buf = be.alloc_descriptors(len(pairs), tag=tag)
    src, dst = (np.array([p[i] for p in pairs], dtype=np.int64) for i in (0, 1))
    buf.fill(src, dst, np.full(len(pairs), size, dtype=np.int64))
    be.copy_batch(stream, buf, len(pairs), tag=tag)
    return buf


def _device(be: SimBackend, rows: int = 4) -> tuple[Any, int]:
    dev = be.empty_device((rows, PAGE))
    assert isinstance(dev, np.ndarray)
    dev[...] = np.arange(rows, dtype=np.uint8)[:, None] + 1  # row r holds byte r + 1
    return dev, int(dev.ctypes.data)


def test_host_register_option_is_validated() -> None:
    with pytest.raises(InvalidTransferError, match="host_register must be 'allow' or 'refuse'"):
        SimBackend(host_register="sometimes")
    assert SimBackend().refuses_registration is False
    assert SimBackend(host_register="refuse").refuses_registration is True


def test_a_refusing_platform_raises_the_typed_error_for_every_registration_and_is_not_sticky() -> None:
    be = _sim(host_register="refuse")
    host = np.zeros(4 * PAGE, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    for size in (PAGE, 4 * PAGE):  # every size
        with pytest.raises(RegistrationRefused) as info:
            be.host_register(int(host.ctypes.data), size)
        assert info.value.status == CUDA_ERROR_NOT_SUPPORTED and isinstance(info.value, DeviceError)
    assert be.registrations() == [] and "pinned" not in be.ledger.live()
    stream = be.create_stream()  # not sticky: the device works on, from pageable memory
    dev, dev_ptr = _device(be)
    _copy(be, stream, [(dev_ptr, int(host.ctypes.data))])
    event = be.create_event()
    be.record(event, stream)
    be.synchronize(event)
    assert (host[:PAGE] == 1).all() and not be.violations
    assert be.monotonic() == pytest.approx(LATENCY + PAGE / PAGEABLE_BW)


@pytest.mark.rule("R16")
@pytest.mark.rule("R25")
def test_alloc_pinned_is_tracked_pinned_memory_with_its_own_ledger_kind() -> None:
    be = _sim(host_register="refuse")  # allocation works where registration is refused
    ptr, buffer = pinned.alloc_pinned(be, 3 * PAGE)
    assert ptr % 4096 == 0 and buffer.size == 3 * PAGE and int(buffer.ctypes.data) == ptr and not buffer.any()
    assert be.ledger.live() == {"pinned_alloc": 1}
    assert be.registrations() == [], "an allocation is not a registration"
    stream = be.create_stream()
    dev, dev_ptr = _device(be)
    # one copy over the whole allocation: pinned speed, no registration seam inside it (R25)
    _copy(be, stream, [(dev_ptr, ptr)], size=3 * PAGE)
    event = be.create_event()
    be.record(event, stream)
    be.synchronize(event)
    assert be.monotonic() == pytest.approx(LATENCY + 3 * PAGE / PINNED_BW)
    assert (buffer[:PAGE] == 1).all() and (buffer[PAGE: 2 * PAGE] == 2).all() and not be.violations
    with pytest.raises(DeviceError) as info:  # freed, never unregistered
        be.host_unregister(ptr)
    assert info.value.status == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    pinned.free_pinned(be, ptr)
    assert "pinned_alloc" not in be.ledger.live() and be.ledger.released()["pinned_alloc"] == 1


def test_alloc_pinned_checks_its_size() -> None:
    with pytest.raises(InvalidTransferError):
        SimBackend().alloc_pinned(0)


@pytest.mark.parametrize("pending", [True, False], ids=["pending-at-free", "submitted-after-free"])
def test_a_copy_touching_freed_pinned_memory_is_flagged_like_unmapped_memory(pending: bool) -> None:
    be = _sim()
    ptr, buffer = be.alloc_pinned(PAGE)
    stream = be.create_stream()
    _, dev_ptr = _device(be)
    if pending:
        _copy(be, stream, [(dev_ptr, ptr)])
    be.free_pinned(ptr)
    if not pending:
        _copy(be, stream, [(dev_ptr, ptr)])
    be.sleep(1.0)
    assert [v.kind for v in be.violations][:1] == ["unmap_under_dma" if pending else "illegal_address"]
    assert not buffer.any(), "the sim never touches memory that was given back"


def test_freeing_an_unknown_allocation_is_an_invalid_release_and_untrack_host_does_not_free_one() -> None:
    be = _sim()
    ptr, _ = be.alloc_pinned(PAGE)
    be.untrack_host(ptr)  # an allocation is not a tracked mapping
    assert [v.kind for v in be.violations] == ["invalid_release"]
    assert be.ledger.live() == {"pinned_alloc": 1}
    be.free_pinned(ptr)
    be.free_pinned(ptr)  # a second free
    assert [v.kind for v in be.violations] == ["invalid_release", "invalid_release"]
    assert be.ledger.live() == {}


def test_a_backend_without_alloc_pinned_refuses_with_a_clear_device_error() -> None:
    class Plain:  # a third-party backend: only the required protocol (here: its name)
        name = "plain"

    backend: Backend = Plain()  # type: ignore[assignment]
    with pytest.raises(DeviceError, match="cannot allocate pinned host memory") as info:
        pinned.alloc_pinned(backend, PAGE)
    assert info.value.status == CUDA_ERROR_NOT_SUPPORTED
    with pytest.raises(DeviceError, match="cannot free pinned host memory"):
        pinned.free_pinned(backend, 4096)
    assert pinned.refuses_registration(backend) is False


def test_faulty_backend_delegates_the_allocation_and_its_free_is_the_unmap_fault_point() -> None:
    sim = _sim(host_register="refuse")
    faulty = kv.FaultyBackend(sim, kv.FaultPlan([kv.Fault("unmap", "error", nth=1)]))
    assert pinned.refuses_registration(faulty) and isinstance(faulty, pinned.PinnedAllocBackend)
    ptr, _ = pinned.alloc_pinned(faulty, PAGE)
    with pytest.raises(DeviceError):
        pinned.free_pinned(faulty, ptr)  # the injected fault: nothing freed
    assert sim.ledger.live() == {"pinned_alloc": 1}
    pinned.free_pinned(faulty, ptr)
    assert sim.ledger.live() == {}
