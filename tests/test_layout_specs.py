"""kvoffload_ref.specs: the integer validator (check_int), its real-number counterparts (check_seconds,
check_positive, check_timeout), and the specs' refusal of bools and of ids beyond int64 among block ids."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.planner import Planner
from kvoffload_ref.specs import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVCacheLayout,
    LayerRef,
    TensorGeometry,
    check_id_array,
    check_positive,
    check_seconds,
    check_timeout,
)
from kvoffload_ref.validate import check_int

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
    with pytest.raises(InvalidTransferError, match=rf"^num_cpu_chunks must be an int, got {shown} \(e\.g\. 1\)$"):
        check_int("num_cpu_chunks", value, minimum=1)


@pytest.mark.rule("R7")
def test_layout_specs_check_int_bounds() -> None:
    assert check_int("rank", 0, minimum=0, maximum=3) == 0 and check_int("x", -5) == -5
    with pytest.raises(InvalidTransferError, match=r"^blocks_per_chunk must be >= 1, got 0 \(e\.g\. 1\)$"):
        check_int("blocks_per_chunk", np.int64(0), minimum=1)
    with pytest.raises(InvalidTransferError, match=r"^rank must be an int in \[0, 3\], got 4 \(e\.g\. 0\)$"):
        check_int("rank", 4, minimum=0, maximum=3)
    with pytest.raises(InvalidTransferError, match=r"^x must be <= 3, got 4 \(e\.g\. 0\)$"):
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
    with pytest.raises(InvalidTransferError, match=r"^blocks_per_chunk must be an int, got bool True \(e\.g\. 1\)$"):
        Planner(layout, gpu, [TensorGeometry(0x90000, 4, 512, 512)], True)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- real numbers: seconds, rates, timeouts

#: The bad numbers of R7's audit, with what each must be refused for (matched against the message); None is one
#: too, except for a timeout (no bound).
NONE = pytest.param(None, "got NoneType", id="None")
BAD_NUMBERS = [
    pytest.param(10**400, "too large", id="10**400"),
    pytest.param(-10**400, "negative", id="-10**400"),
    pytest.param(float("nan"), "NaN", id="nan"),
    pytest.param(float("-inf"), "negative", id="-inf"),
    pytest.param(True, "got bool True", id="True"),
    pytest.param(np.True_, "got bool", id="np.True_"),
    pytest.param("1", "got str '1'", id="str"),
    pytest.param(-1, "negative", id="-1"),
    pytest.param(-0.5, "negative", id="-0.5"),
    pytest.param(np.longdouble("1e400") if np.finfo(np.longdouble).maxexp > 1024 else 10**401, "too large",
                 id="longdouble-1e400"),
]


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("value", "why"), [*BAD_NUMBERS, NONE, pytest.param(float("inf"), "infinite", id="inf")])
def test_layout_specs_check_seconds_refuses_bad_numbers_naming_the_parameter(value: Any, why: str) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^delay\b.*{re.escape(why)}"):
        check_seconds("delay", value)


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("value", "why"), BAD_NUMBERS)
def test_layout_specs_check_timeout_refuses_bad_numbers_naming_timeout(value: Any, why: str) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^timeout\b.*{re.escape(why)}"):
        check_timeout(value)


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("value", "why"), [*BAD_NUMBERS, NONE, pytest.param(float("inf"), "infinite", id="inf"),
                                            pytest.param(0, "zero", id="0"), pytest.param(0.0, "zero", id="0.0")])
def test_layout_specs_check_positive_refuses_bad_numbers_and_zero(value: Any, why: str) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^pinned_bandwidth\b.*{re.escape(why)}"):
        check_positive("pinned_bandwidth", value, unit="bytes per second")


@pytest.mark.rule("R7")
def test_layout_specs_an_int_too_large_for_a_float_is_named_by_its_size() -> None:
    with pytest.raises(InvalidTransferError, match=r"^timeout = an int of 1329 bits is too large: it does not fit in "
                                                   r"a float \(at most 1\.798e\+308 seconds\); pass math\.inf for no "
                                                   r"bound$"):
        check_timeout(10**400)
    with pytest.raises(InvalidTransferError, match=r"^delay = an int of 16610 bits is too large.*seconds\)$"):
        check_seconds("delay", 10**5000)  # str() of this int would raise ValueError (over 4300 digits)
    with pytest.raises(InvalidTransferError, match=r"^x must be <= 3, got an int of 16610 bits \(e\.g\. 0\)$"):
        check_int("x", 10**5000, maximum=3)
    with pytest.raises(InvalidTransferError, match=r"^x must be an int in \[0, 3\], got a negative int of 16610 bits"
                                                   r" \(e\.g\. 0\)$"):
        check_int("x", -10**5000, minimum=0, maximum=3)


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("value", "expected"), [
    (0, 0.0), (3, 3.0), (2.5, 2.5), (np.int64(4), 4.0), (np.uint8(1), 1.0), (np.float32(0.5), 0.5),
    (np.float64(1e300), 1e300), (2**1023, float(2**1023)), (1e308, 1e308),
])
def test_layout_specs_real_validators_accept_finite_numbers_as_python_floats(value: Any, expected: float) -> None:
    for result in (check_seconds("s", value), check_seconds("s", value, allow_inf=True), check_timeout(value)):
        assert result == expected and type(result) is float
    if expected > 0:
        got = check_positive("rate", value, unit="bytes per second")
        assert got == expected and type(got) is float


@pytest.mark.rule("R7")
def test_layout_specs_infinity_means_no_bound_only_where_allowed() -> None:
    assert check_timeout(math.inf) is None and check_timeout(np.float64("inf")) is None and check_timeout(None) is None
    assert check_seconds("s", math.inf, allow_inf=True) == math.inf
    with pytest.raises(InvalidTransferError, match=r"^s is infinite: expected a finite number of seconds >= 0"
                                                   r" \(e\.g\. 1\.0\)$"):
        check_seconds("s", math.inf)
    with pytest.raises(InvalidTransferError, match="negative"):
        check_seconds("s", -math.inf, allow_inf=True)


# ------------------------------------------------------------------------------- ints beyond the int64 range


@pytest.mark.rule("R7")
@pytest.mark.parametrize("ids", [[2**63], [2**70, 1], [-2**63 - 1], [10**400], np.array([2**63], dtype=np.uint64)],
                         ids=["2**63", "2**70", "below-int64", "10**400", "uint64"])
def test_layout_specs_block_ids_beyond_int64_are_refused_as_such(ids: Any) -> None:
    with pytest.raises(InvalidTransferError, match=r"^CPULoadStoreSpec\.block_ids must fit in int64, got "):
        CPULoadStoreSpec(ids)
    with pytest.raises(InvalidTransferError, match=r"^GPULoadStoreSpec\.block_ids must fit in int64, got "):
        GPULoadStoreSpec(ids, (len(ids),), (0,))


@pytest.mark.rule("R7")
def test_layout_specs_page_sizes_must_fit_the_planners_int64_arrays() -> None:
    for page in (2**63, 2**70, 10**400):
        with pytest.raises(InvalidTransferError, match=r"^tensor_page_bytes\[0\] must be an int in \[1, "
                                                       r"9223372036854775807\], got "):
            KVCacheLayout([page], [[LayerRef(0, 512)]])
    biggest = KVCacheLayout([2**63 - 1], [[LayerRef(0, 2**63 - 1)]])   # valid; a geometry check bounds it further
    assert biggest.tensor_page_bytes == (2**63 - 1,)


@pytest.mark.rule("R7")
def test_layout_specs_check_id_array_names_the_parameter_and_the_ids() -> None:
    assert check_id_array("rows", [3, np.int64(1)]).tolist() == [3, 1]
    assert check_id_array("rows", []).dtype == np.int64
    with pytest.raises(InvalidTransferError, match=r"^rows\[1\] = True is a bool: pass integer rows$"):
        check_id_array("rows", [0, True], noun="rows")
    with pytest.raises(InvalidTransferError, match=r"^rows\[0\] = -1 is negative: expected >= 0$"):
        check_id_array("rows", [-1])
    with pytest.raises(InvalidTransferError, match=r"^rows must have an integer dtype \(e\.g\. \[0, 1, 2\]\), got"
                                                   r" float64$"):
        check_id_array("rows", [1.5])
