"""Tests of the CuPy backend's pure parsing (kvoffload_ref/backends/_cupy_interop.py): CUDA array interface dicts
as torch, CuPy, JAX and Numba write them, DLPack devices, and compute-stream objects. No CuPy, no GPU."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload_ref.backends._cupy_interop import (
    ByteView,
    check_dlpack_device,
    check_shape,
    parse_cuda_array_interface,
    parse_stream_object,
)
from kvoffload_ref.errors import InvalidTransferError

PTR = 0x7F00_0000_0000


def cai(shape: tuple[int, ...], typestr: str = "<V2", strides: tuple[int, ...] | None = None,
        **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": shape, "typestr": typestr, "data": (PTR, False), "version": 2}
    if strides is not None:
        out["strides"] = strides
    out.update(extra)
    return out


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(int(s) for s in np.empty(shape, dtype=f"V{itemsize}").strides)


@pytest.mark.parametrize(("interface", "expected"), [
    # torch bf16 KV cache (num_blocks, block_size, num_heads, head_dim), C-contiguous: strides omitted (v2)
    (cai((64, 16, 8, 128)), ByteView(PTR, 64, 16 * 8 * 128 * 2, 16 * 8 * 128 * 2)),
    # the same with explicit strides (v3 producers may always give them)
    (cai((64, 16, 8, 128), strides=c_strides((64, 16, 8, 128), 2), version=3),
     ByteView(PTR, 64, 32768, 32768)),
    # fp16, uint8 pages, float32, complex: any dtype
    (cai((10, 4, 32), "<f2"), ByteView(PTR, 10, 256, 256)),
    (cai((10, 4096), "|u1"), ByteView(PTR, 10, 4096, 4096)),
    (cai((3, 5), "<f4"), ByteView(PTR, 3, 20, 20)),
    (cai((3, 2), "<c16"), ByteView(PTR, 3, 32, 32)),
    # padded blocks: a view big[:, :16] of (N, 20, 8, 128): the block stride exceeds the block
    (cai((64, 16, 8, 128), strides=(20 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2)),
     ByteView(PTR, 64, 32768, 40960)),
    # size-1 dimensions may carry any stride (frameworks report arbitrary ones)
    (cai((4, 1, 8), "<f2", strides=(16, 999, 2)), ByteView(PTR, 4, 16, 16)),
    # one block: its stride does not matter
    (cai((1, 8), "<f2", strides=(0, 2)), ByteView(PTR, 1, 16, 16)),
    # 1-D: a block is one element
    (cai((7,), "<i8"), ByteView(PTR, 7, 8, 8)),
    # version 0 (no strides key) and big-endian typestr: bytes are bytes
    (cai((2, 3), ">i4", version=0), ByteView(PTR, 2, 12, 12)),
    # empty: no rows
    ({**cai((0, 16), "<f2"), "data": (0, False)}, ByteView(0, 0, 32, 32)),
])
def test_parse_cuda_array_interface_views_bytes(interface: dict[str, Any], expected: ByteView) -> None:
    assert parse_cuda_array_interface(interface) == expected


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), itemsize=st.sampled_from([1, 2, 4, 8, 16]),
       pad=st.integers(0, 64))
def test_parse_cuda_array_interface_matches_numpy_byte_view(shape: list[int], itemsize: int, pad: int) -> None:
    """Against numpy: a padded C-contiguous block layout is parsed to exactly numpy's byte view of one block."""
    dims = tuple(shape)
    inner = c_strides(dims, itemsize)
    block = itemsize * math.prod(dims[1:])
    strides = (block + pad * itemsize, *inner[1:])
    view = parse_cuda_array_interface(cai(dims, f"|V{itemsize}", strides=strides))
    assert view.row_bytes == block
    assert view.rows == dims[0]
    assert view.row_stride == (block + pad * itemsize if dims[0] > 1 else block)
    assert view.nbytes == (dims[0] - 1) * view.row_stride + block


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("interface", "why"), [
    ([("shape", (2, 2))], "not a dict"),
    (cai((2, 2), version=4), "unsupported __cuda_array_interface__ version 4"),
    (cai((2, 2), version=None), "unsupported __cuda_array_interface__ version None"),
    (cai((2, 2), mask={"shape": (2, 2)}), "masked arrays are not supported"),
    (cai(()), "shape must be a non-empty tuple"),
    (cai((2, -1)), "shape must be a non-empty tuple"),
    (cai((2, True)), "shape must be a non-empty tuple"),
    (cai((2, 2), "bfloat16"), "unsupported typestr 'bfloat16'"),
    (cai((2, 2), "<f0"), "unsupported typestr"),
    ({**cai((2, 2)), "data": (PTR, True)}, "read-only"),
    ({**cai((2, 2)), "data": PTR}, r"data must be \(pointer, read_only\)"),
    ({**cai((2, 2)), "data": (0, False)}, "null data pointer"),
    (cai((2, 2), strides=(4,)), "strides must be None or 2 ints"),
    # a transposed block (head_dim-major): not C-contiguous within the block
    (cai((4, 8, 16), "<f2", strides=(256, 2, 16)), r"a block is not contiguous: dimension 1 has stride 2 bytes"),
    # every other element: strided innermost dimension
    (cai((4, 8), "|u1", strides=(16, 2)), "dimension 1 has stride 2 bytes, C order needs 1"),
    # blocks overlapping or running backwards
    (cai((4, 8), "<f2", strides=(8, 2)), r"block stride 8 bytes is smaller than a block \(16 bytes\)"),
    (cai((4, 8), "<f2", strides=(-16, 2)), "smaller than a block"),
    # block dimension last (torch's (heads, dim, blocks) layout): not the first dimension
    (cai((8, 4), "<f2", strides=(2, 16)), "not contiguous"),
])
def test_parse_cuda_array_interface_refuses_and_names_the_tensor(interface: object, why: str) -> None:
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[5\]: .*" + why):
        parse_cuda_array_interface(interface, name="gpu_tensors[5]")


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("dl_device", "why"), [
    ((1, 0), r"host memory \(DLPack device type 1\)"),
    ((3, 0), r"host memory \(DLPack device type 3\)"),
    ((10, 0), r"not a CUDA tensor \(DLPack device type 10\)"),
    ((2, 1), "is on cuda:1, the backend on cuda:0"),
    ("cuda:0", r"must return \(device_type, device_id\)"),
])
def test_check_dlpack_device_refusals(dl_device: object, why: str) -> None:
    with pytest.raises(InvalidTransferError, match=r"^gpu_tensors\[0\]: .*" + why):
        check_dlpack_device(dl_device, 0, name="gpu_tensors[0]")


def test_check_dlpack_device_accepts_cuda_and_managed() -> None:
    check_dlpack_device((2, 1), 1)
    check_dlpack_device((13, 0), 0)


class CupyLikeStream:
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        self.ptr, self.device_id = ptr, device_id

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@pytest.mark.parametrize(("stream", "expected"), [
    (0, (0, None)),
    (1, (1, None)),
    (np.uint64(0x1234), (0x1234, None)),
    (type("TorchStream", (), {"cuda_stream": 0x55, "device_index": 1})(), (0x55, 1)),
    (CupyLikeStream(0x66), (0x66, None)),  # device_id -1: unknown
    (CupyLikeStream(0x66, device_id=0), (0x66, 0)),
    (type("AttrProtocol", (), {"__cuda_stream__": (0, 0x77)})(), (0x77, None)),
])
def test_parse_stream_object(stream: object, expected: tuple[int, int | None]) -> None:
    assert parse_stream_object(stream) == expected


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("stream", "why"), [
    (None, "expected a cudaStream_t int"),
    ("0x55", "expected a cudaStream_t int"),
    (False, "a bool is not a stream"),
    (-5, "negative"),
    (2, "per-thread default stream"),
    (CupyLikeStream(2), "per-thread default stream"),
    (type("Bad", (), {"__cuda_stream__": lambda self: 1 / 0})(), r"__cuda_stream__\(\) raised ZeroDivisionError"),
    (type("Bad", (), {"__cuda_stream__": (0, "x")})(), r"must give \(version, handle\)"),
])
def test_parse_stream_object_refusals(stream: object, why: str) -> None:
    with pytest.raises(InvalidTransferError, match=r"^compute_stream: .*" + why):
        parse_stream_object(stream)


def test_check_shape() -> None:
    assert check_shape((3, np.int64(4))) == (3, 4)
    for bad in ((2,), (2, -1), (2.0, 3), (True, 3), "2x3"):
        with pytest.raises(InvalidTransferError):
            check_shape(bad)
