"""kvoffload_ref.validate: what tests/test_layout_specs.py does not cover through the re-exports -- the
re-exports themselves, and check_job_ids called directly (the worker tests reach it only through wait)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from kvoffload_ref import specs, validate
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


@pytest.mark.parametrize("value", [8, "12", b"12", None, 1.5])
def test_validate_check_job_ids_refuses_a_non_iterable(value: Any) -> None:
    with pytest.raises(InvalidTransferError, match=rf"^job_ids must be an iterable of job ids .*got "
                                                   rf"{re.escape(type(value).__name__)}$"):
        validate.check_job_ids(value)


@pytest.mark.parametrize("value", [True, np.True_, 1.5, "3", None])
def test_validate_check_job_ids_refuses_an_element_that_is_not_an_int(value: Any) -> None:
    with pytest.raises(InvalidTransferError, match=r"^job_id must be an int, got "):
        validate.check_job_ids([1, value])


def test_validate_check_job_ids_names_a_huge_non_iterable_by_its_size() -> None:
    with pytest.raises(InvalidTransferError, match=r"^job_ids must be .*\{an int of 13288 bits\}"):
        validate.check_job_ids(10**4000)  # str() of it would raise ValueError
