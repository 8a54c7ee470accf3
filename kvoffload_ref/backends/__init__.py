"""Device backends: the protocol (``base``), the simulated device (``sim``) and CuPy (``cupy``).

:func:`get_backend` picks one by name. The CuPy backend module is imported only when asked for (it may be
missing or broken on a machine without a GPU).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Final, Literal, cast, overload

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.backends.sim import SimBackend

if TYPE_CHECKING:  # the CuPy backend module is imported only when asked for (see the module docstring)
    from kvoffload_ref.backends.cupy import CupyBackend

__all__ = ["BACKEND_NAMES", "get_backend"]

BACKEND_NAMES: Final = ("auto", "sim", "cupy")

_log = logging.getLogger("kvoffload_ref")


@overload
def get_backend(name: Literal["sim"], **kwargs: Any) -> SimBackend: ...
@overload
def get_backend(name: Literal["cupy"], **kwargs: Any) -> CupyBackend: ...
@overload
def get_backend(name: Literal["auto"] = "auto", **kwargs: Any) -> Backend: ...
@overload
def get_backend(name: str, **kwargs: Any) -> Backend: ...


def get_backend(name: str = "auto", **kwargs: Any) -> Backend:
    """Make a backend by name (typed per name: ``get_backend("sim")`` is a :class:`SimBackend`,
    ``get_backend("cupy")`` a ``CupyBackend``, anything else a :class:`Backend`).

    Args:
        name: ``"sim"`` (the simulated device), ``"cupy"`` (a CUDA GPU through CuPy), or ``"auto"``: CuPy when
            its backend imports and reports a usable GPU, else the simulated device (logging one INFO line on
            the ``kvoffload_ref`` logger saying why).
        **kwargs: passed to the chosen backend's constructor (for ``"sim"``: e.g. ``profile="h200"``, a cost
            profile of ``backends.sim_profiles``, with ``latency=``/``pinned_bandwidth=`` as overrides; ``trace=True``).

    Returns:
        The backend.

    Raises:
        ValueError: an unknown name.
        ImportError: ``"cupy"`` was asked for and its backend cannot be imported.
    """
    if name == "sim":
        return SimBackend(**kwargs)
    if name == "cupy":
        return cast(Backend, _cupy_module().CupyBackend(**kwargs))
    if name == "auto":
        return _auto(**kwargs)
    raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(map(repr, BACKEND_NAMES))}")


def _cupy_module() -> Any:
    return importlib.import_module("kvoffload_ref.backends.cupy")


def _auto(**kwargs: Any) -> Backend:
    try:
        module = _cupy_module()
    except ImportError as exc:
        _log.info("CuPy backend not available (%s); using the simulated device", exc)
        return SimBackend(**kwargs)
    usable, reason = module.gpu_usable()
    if not usable:
        _log.info("No usable GPU (%s); using the simulated device", reason)
        return SimBackend(**kwargs)
    return cast(Backend, module.CupyBackend(**kwargs))
