"""kvoffload_ref.validate: what tests/test_layout_specs.py does not cover through the re-exports -- the
re-exports themselves, and check_job_ids called directly (the worker tests reach it only through wait)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref import specs, validate
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import InvalidTransferError

PUBLIC = ["check_int", "check_seconds", "check_positive", "check_timeout", "check_job_ids", "check_id_array"]


@pytest.mark.parametrize("name", PUBLIC)
def test_validate_specs_re_exports_the_same_validators(name: str) -> None:
    assert name in validate.__all__ and name in specs.__all__
    assert getattr(specs, name) is getattr(validate, name)


def test_validate_check_job_ids_accepts_any_ints() -> None:
    big = 2**200  # job ids are only compared and hashed: beyond int64 is fine
    result = validate.check_job_ids([1, np.int64(2), big, 1])
    assert result == {1, 2, big} and all(type(job) is int for job in result)
    assert validate.check_job_ids(job for job in range(3)) == {0, 1, 2}
    assert validate.check_job_ids(set()) == set()


@pytest.mark.rule("R7")
@pytest.mark.parametrize("kind", [list, tuple, set, frozenset])
def test_validate_check_job_ids_plain_ints_in_a_known_container_are_checked_like_any(kind: Any) -> None:
    """A list, tuple, set or frozenset of plain ints is taken whole (no check per element); anything else in it --
    a bool, an int subclass, a numpy int -- is checked one by one: refused, or converted to a plain int."""
    class Job(enum.IntEnum):
        FIRST = 4

    assert validate.check_job_ids(kind([3, 2**70])) == {3, 2**70}
    assert validate.check_job_ids(range(2, 5)) == {2, 3, 4}
    converted = validate.check_job_ids(kind([3, Job.FIRST, np.int64(5)]))
    assert converted == {3, 4, 5} and all(type(job) is int for job in converted)
    with pytest.raises(InvalidTransferError, match=r"^job_id must be an int, got bool True"):
        validate.check_job_ids(kind([3, True]))


@pytest.mark.parametrize("value", [8, "12", b"12", None, 1.5])
def test_validate_check_job_ids_refuses_a_non_iterable(value: Any) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^job_ids must be an iterable of job ids .*got "
                                                   rf"{re.escape(type(value).__name__)} {re.escape(repr(value))}$"):
        validate.check_job_ids(value)


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [None, "12", 1.5, object])
def test_validate_check_job_ids_suggests_a_valid_example(value: Any) -> None:
    """``wait(None)`` once suggested ``{None}``, itself refused: the example offered must pass the check."""
    with pytest.raises(InvalidTransferError) as info:
        validate.check_job_ids(value)
    example = re.search(r"\(e\.g\. (\{[^}]*\})", str(info.value))
    assert example is not None, str(info.value)
    validate.check_job_ids(eval(example.group(1)))
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [True, np.True_, 1.5, "3", None])
def test_validate_check_job_ids_refuses_an_element_that_is_not_an_int(value: Any) -> None:
    with pytest.raises(InvalidTransferError, match=r"^job_id must be an int, got "):
        validate.check_job_ids([1, value])


def test_validate_check_job_ids_names_a_huge_non_iterable_by_its_size() -> None:
    with pytest.raises(InvalidTransferError, match=r"^job_ids must be .*\{an int of 13288 bits\}"):
        validate.check_job_ids(10**4000)  # str() of it would raise ValueError


# ------------------------------------------------------------- every refusal names its field, the value, an example
_LAYOUT = kv.KVCacheLayout(tensor_page_bytes=(512, 512), groups=((kv.LayerRef(0, 512), kv.LayerRef(1, 512)),))


def _gspec(ids: Any = (5, 9, 1)) -> kv.GPULoadStoreSpec:
    return kv.GPULoadStoreSpec(ids, group_sizes=(3,), block_indices=(0,))


#: (field, bad value, a call that passes the value as that field to a worker ``w`` built by ``make`` on ``be``).
BAD_INPUTS: list[tuple[str, Any, Callable[[Any, Any, Any], object]]] = [
    ("job_ids", None, lambda w, be, make: w.wait(None)),
    ("job_ids", 7, lambda w, be, make: w.cancel(7)),
    ("job_id", "a", lambda w, be, make: w.submit_store("a", _gspec(), kv.CPULoadStoreSpec([1]))),
    ("job_id", 1.5, lambda w, be, make: w.wait({1.5})),
    ("timeout", -1, lambda w, be, make: w.wait({1}, timeout=-1)),
    ("timeout", "1", lambda w, be, make: w.wait({1}, timeout="1")),
    ("deadline", 0, lambda w, be, make: w.submit_store(1, _gspec(), kv.CPULoadStoreSpec([1]), deadline=0)),
    ("deadline", -2.0, lambda w, be, make: w.submit_load(1, kv.CPULoadStoreSpec([1]), _gspec(), deadline=-2.0)),
    ("block_ids", "generator", lambda w, be, make: _gspec(i for i in (5, 9, 1))),
    ("block_ids", "(1, 3)", lambda w, be, make: _gspec([[5, 9, 1]])),
    ("block_ids", "float64", lambda w, be, make: kv.CPULoadStoreSpec([1.0])),
    ("blocks_per_chunk", 0, lambda w, be, make: make(be, [], _LAYOUT, blocks_per_chunk=0, num_cpu_chunks=4)),
    ("num_cpu_chunks", -1, lambda w, be, make: make(be, [], _LAYOUT, blocks_per_chunk=3, num_cpu_chunks=-1)),
    ("num_cpu_chunks", "4", lambda w, be, make: make(be, [], _LAYOUT, blocks_per_chunk=3, num_cpu_chunks="4")),
    ("timeout", -1, lambda w, be, make: kv.ShutdownPolicy(timeout=-1)),
    ("on_unproven", "free", lambda w, be, make: kv.ShutdownPolicy(on_unproven="free")),
    ("tensor_page_bytes", 512, lambda w, be, make: kv.KVCacheLayout(512, [[kv.LayerRef(0, 1)]])),
    ("page_size_bytes", 0, lambda w, be, make: kv.LayerRef(0, 0)),
    ("group_sizes", 3, lambda w, be, make: kv.GPULoadStoreSpec([1, 2, 3], 3, (0,))),
    ("groups[0][0]", (0, 512), lambda w, be, make: kv.KVCacheLayout((512,), [[(0, 512)]])),
    ("policy", "free", lambda w, be, make: make(be, [], _LAYOUT, blocks_per_chunk=3, num_cpu_chunks=4,
                                                policy="free")),
    ("sticky", "hang", lambda w, be, make: kv.Fault("copy", "hang", sticky=True)),
    ("duration", "slow", lambda w, be, make: kv.Fault("copy", "slow")),
]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("create", ["create_worker", "create_reference_worker"])
@pytest.mark.parametrize(("field", "value", "call"), BAD_INPUTS, ids=[f"{f}={v!r}" for f, v, _ in BAD_INPUTS])
def test_validate_every_refusal_names_its_field_the_value_and_a_valid_example(
        create: str, field: str, value: Any, call: Callable[[Any, Any, Any], object]) -> None:
    be = SimBackend()
    make = getattr(kv, create)
    gpu = [be.empty_device((64, 512)) for _ in range(2)]
    with make(be, gpu, _LAYOUT, blocks_per_chunk=3, num_cpu_chunks=16) as w:
        with pytest.raises(InvalidTransferError) as info:
            call(w, be, make)
        assert w.get_finished() == []  # R7: refused before anything changed
    text = str(info.value)
    assert field in text, text
    assert (value if isinstance(value, str) else repr(value)) in text, text
    assert "e.g." in text or re.search(r"must be '\w+' or '\w+'", text), text  # an example, or every valid value
