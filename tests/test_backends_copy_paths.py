"""kvoffload_ref.backends.copy_paths: one check of a backend's ``copy_path`` for every backend (R7)."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload_ref.backends.copy_paths import COPY_PATHS, check_copy_path
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import InvalidTransferError


@pytest.mark.parametrize("path", COPY_PATHS)
def test_copy_paths_each_path_is_accepted_as_itself(path: str) -> None:
    assert check_copy_path(path) == path
    assert check_copy_path("".join(path)) == path  # an equal string, not the same object


@pytest.mark.rule("R7")
@pytest.mark.parametrize("bad", ["fast", "AUTO", "", None, 1, b"auto", np.array(["auto", "kernel"]), ["auto"]])
def test_copy_paths_anything_else_is_refused_with_the_accepted_values(bad: object) -> None:
    with pytest.raises(InvalidTransferError, match=r"^copy_path must be 'auto', 'kernel' or 'memcpy'; got "):
        check_copy_path(bad)
    with pytest.raises(ValueError, match=r"^copy_path must be"):  # the sim refuses it with the same check
        SimBackend(copy_path=bad)  # type: ignore[arg-type]
