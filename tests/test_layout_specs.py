"""kvoffload_ref.specs: the one integer validator (check_int) and the specs' refusal of bools among block ids."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.layout import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef, check_int
from kvoffload_ref.planner import Planner
from kvoffload_ref.specs import TensorGeometry

# ----------------------------------------------------------------------------------------------- check_int


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), np.intp(3)])
def test_layout_specs_check_int_accepts_python_and_numpy_ints(value: Any) -> None:
    result = check_int("blocks_per_chunk", value, minimum=1)
    assert result == 3 and type(result) is int


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [True, np.True_, 2.0, np.float64(2.0), "2", None, np.array(2)])
def test_layout_specs_check_int_refuses_non_ints_naming_the_parameter(value: Any) -> None:
    shown = re.escape(f"{type(value).__name__} {value!r}")
    with pytest.raises(InvalidTransferError, match=rf"^num_cpu_chunks must be an int, got {shown}$"):
        check_int("num_cpu_chunks", value, minimum=1)


@pytest.mark.rule("R7")
def test_layout_specs_check_int_bounds() -> None:
    assert check_int("rank", 0, minimum=0, maximum=3) == 0 and check_int("x", -5) == -5
    with pytest.raises(InvalidTransferError, match=r"^blocks_per_chunk must be >= 1, got 0$"):
        check_int("blocks_per_chunk", np.int64(0), minimum=1)
    with pytest.raises(InvalidTransferError, match=r"^rank must be an int in \[0, 3\], got 4$"):
        check_int("rank", 4, minimum=0, maximum=3)
    with pytest.raises(InvalidTransferError, match=r"^x must be <= 3, got 4$"):
        check_int("x", 4, maximum=3)


# ---------------------------------------------------------------------------------------- bools among ids


@pytest.mark.rule("R7")
@pytest.mark.parametrize("make", [
    lambda: GPULoadStoreSpec([True, 5], (2,), (0,)),
    lambda: GPULoadStoreSpec((5, False), (2,), (0,)),
    lambda: GPULoadStoreSpec([np.True_, 5], (2,), (0,)),
    lambda: GPULoadStoreSpec([np.int64(4), np.bool_(False)], (2,), (0,)),
    lambda: CPULoadStoreSpec([False, 3]),
    lambda: CPULoadStoreSpec([3, np.array(True)]),
    lambda: CPULoadStoreSpec(np.array([True, False])),
    lambda: CPULoadStoreSpec(np.array([], dtype=bool)),
], ids=["gpu-list", "gpu-tuple", "gpu-np-true", "gpu-np-false", "cpu-list", "cpu-0d-array", "cpu-bool-array",
        "cpu-empty-bool-array"])
def test_layout_specs_refuse_a_bool_among_block_ids(make: Any) -> None:
    with pytest.raises(InvalidTransferError, match=r"block_ids.*bool"):
        make()


@pytest.mark.rule("R7")
def test_layout_specs_mixed_bool_message_names_the_position() -> None:
    with pytest.raises(InvalidTransferError,
                       match=r"^CPULoadStoreSpec\.block_ids\[1\] = False is a bool: pass integer block ids$"):
        CPULoadStoreSpec([3, False])


@pytest.mark.rule("R7")
def test_layout_specs_integer_ids_of_every_kind_still_pass() -> None:
    assert CPULoadStoreSpec([np.int64(1), 2, np.uint16(3)]).block_ids.tolist() == [1, 2, 3]
    assert CPULoadStoreSpec(np.arange(4, dtype=np.int32)).block_ids.tolist() == [0, 1, 2, 3]
    assert CPULoadStoreSpec(range(3)).block_ids.tolist() == [0, 1, 2]


@pytest.mark.rule("R7")
def test_layout_specs_numpy_blocks_per_chunk_accepted_and_bool_refused_by_the_planner() -> None:
    layout = KVCacheLayout([512], [[LayerRef(0, 512)]])
    gpu = [TensorGeometry(0x10000, 8, 512, 512)]
    cpu = [TensorGeometry(0x90000, 4, 1024, 1024)]
    planner = Planner(layout, gpu, cpu, np.int64(2))  # type: ignore[arg-type]
    assert planner.blocks_per_chunk == 2 and type(planner.blocks_per_chunk) is int
    with pytest.raises(InvalidTransferError, match=r"^blocks_per_chunk must be an int, got bool True$"):
        Planner(layout, gpu, [TensorGeometry(0x90000, 4, 512, 512)], True)  # type: ignore[arg-type]
