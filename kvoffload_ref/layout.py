"""The KV-cache layout, the transfer specs and the copy planner, in one import (pure numpy).

This module re-exports the two halves so that ``from kvoffload_ref.layout import X`` works for all of them:

* :mod:`kvoffload_ref.specs` -- what a caller describes, validated when built (R7): :class:`KVCacheLayout`,
  :class:`LayerRef`, :class:`TensorGeometry`, :class:`GPULoadStoreSpec`, :class:`CPULoadStoreSpec`,
  :func:`check_geometry`, :func:`check_int`, the package's one integer validator, and its real-number
  counterparts :func:`check_seconds`, :func:`check_positive` and :func:`check_timeout`;
* :mod:`kvoffload_ref.planner` -- what a transfer means in bytes: :class:`Planner`, :class:`PreparedPlan`,
  :func:`plan_copies` and the :class:`CopyPlan` they produce.

Both import nothing of the package but ``errors`` (an import-linter contract keeps it so).
"""

from __future__ import annotations

from kvoffload_ref.planner import CopyPlan, Planner, PreparedPlan, plan_copies
from kvoffload_ref.specs import (
    CPULoadStoreSpec,
    Direction,
    GPULoadStoreSpec,
    KVCacheLayout,
    LayerRef,
    TensorGeometry,
    check_geometry,
    check_int,
    check_job_ids,
    check_positive,
    check_seconds,
    check_timeout,
)

__all__ = [
    "TensorGeometry",
    "LayerRef",
    "KVCacheLayout",
    "GPULoadStoreSpec",
    "CPULoadStoreSpec",
    "CopyPlan",
    "Direction",
    "Planner",
    "PreparedPlan",
    "check_geometry",
    "check_int",
    "check_job_ids",
    "check_positive",
    "check_seconds",
    "check_timeout",
    "plan_copies",
]
