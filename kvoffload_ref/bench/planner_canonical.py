"""Bench figures of the copy planner in canonical mode (R24), next to the plain mode's at the same descriptor count.

The case is the planner group's realistic one, sharded: 32 layer tensors in one KV-cache group, ``blocks_per_chunk
= 4``, scattered GPU block ids, the first CPU chunk entered at sub-block 1, store direction, a
:class:`~kvoffload_ref.planner.Planner` built once with this rank's mappings and ``prepare`` + ``write`` into reused
arrays per transfer (the handler's path). Each layer is split NHD KV of 8 KV heads under TP=4, rank 1 (2 local
heads, 16-token blocks, head size 128, bf16): a 16 KiB local page -- the plain case's page -- whose K and V halves
are 16 token rows of 512 bytes each at the rank's head offset of a 64 KiB canonical page, so 32 fragments per block
and layer, no writer filter (one writer). Descriptors = blocks x 32 layers x 32 fragments, at the planner group's
three sizes. The reference is the plain planner's rate at the same size, measured in the same run (the planner
group's ``planner_<size>`` figure). Goal: within 2x of it (ratio >= 0.5) from the middle size on; the plan is
checked equal to the plain placement rule's (``placement.check_transfer`` with the mappings) at the small size.
"""

from __future__ import annotations

import functools
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.bench.common import BPC, LAYERS, Goal, Result, Sizes, best_of, label, result
from kvoffload_ref.canonical_derive import LayerGeometry, ParallelContext, derive_mapping
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.placement import check_transfer
from kvoffload_ref.planner import Planner
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef, TensorGeometry

__all__ = ["GOAL_CANONICAL_VS_PLAIN", "bench_planner_canonical", "canonical_case"]

#: Canonical descriptors per second over plain ones at the same count (issue 19: within 2x).
GOAL_CANONICAL_VS_PLAIN: Final = 0.5
_GEOMETRY: Final = LayerGeometry("split", block_size=16, element_size=2, head_size=128, total_kv_heads=8,
                                 local_kv_heads=2)


def canonical_case(num_descriptors: int, seed: int = 0) -> tuple[Planner, GPULoadStoreSpec, CPULoadStoreSpec]:
    """The canonical planner over synthetic geometries (no memory behind them) and the specs of one store of about
    ``num_descriptors`` descriptors (at least one block).

    Returns:
        (planner, GPU spec, CPU spec).
    """
    mapping = derive_mapping(ParallelContext(tp=4, rank=1), _GEOMETRY)
    canonical = CanonicalLayout([mapping] * LAYERS, rank=1)
    rng = np.random.default_rng(seed)
    page, skip = mapping.local_page_size, 1
    blocks = max(1, num_descriptors // (LAYERS * mapping.num_fragments))
    chunks = -(-(blocks + skip) // BPC)
    gpu_rows, cpu_rows = 2 * blocks, 2 * chunks
    layout = KVCacheLayout([page] * LAYERS, [[LayerRef(t, page) for t in range(LAYERS)]])
    gpu = tuple(TensorGeometry(0x7F00_0000_0000 + t * 2**36, gpu_rows, page, page) for t in range(LAYERS))
    row = mapping.canonical_page_size * BPC
    cpu = tuple(TensorGeometry(0x1000_0000 + t * cpu_rows * row, cpu_rows, row, row) for t in range(LAYERS))
    gpu_spec = GPULoadStoreSpec(rng.permutation(gpu_rows)[:blocks], [blocks], [skip])
    cpu_spec = CPULoadStoreSpec(rng.permutation(cpu_rows)[:chunks])
    return Planner(layout, gpu, cpu, BPC, canonical), gpu_spec, cpu_spec


def _check(planner: Planner, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec) -> None:
    """The planner's plan equals the plain rule's (one move per fragment)."""
    plan = planner.plan("store", gpu_spec, cpu_spec)
    gpu, cpu = planner._gpu, planner._cpu
    geo_gpu = [TensorGeometry(int(p), int(r), 0, int(s)) for p, r, s in zip(gpu.ptr, gpu.rows, gpu.stride, strict=True)]
    geo_cpu = [TensorGeometry(int(p), int(r), 0, int(s)) for p, r, s in zip(cpu.ptr, cpu.rows, cpu.stride, strict=True)]
    moves = check_transfer(planner.layout, "store", gpu_spec, cpu_spec, [g.rows for g in geo_gpu],
                           [c.rows for c in geo_cpu], BPC, planner.canonical)
    want = np.array([m.addresses("store", geo_gpu, geo_cpu) for m in moves], dtype=np.int64).reshape(-1, 3)
    if not np.array_equal(np.stack([plan.src, plan.dst, plan.sizes], axis=1), want):
        raise AssertionError("the canonical planner and placement.canonical_moves disagree")


def _plan(planner: Planner, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec,
          out: tuple[npt.NDArray[np.int64], ...]) -> int:
    """The handler's path: validate the specs, write the descriptors into the reused arrays."""
    return planner.prepare("store", gpu_spec, cpu_spec).write(*out)


def bench_planner_canonical(sizes: Sizes, quick: bool, plain: list[float]) -> list[Result]:
    """The canonical planner's rate at the planner group's three sizes.

    Args:
        sizes: the run's sizes (``sizes.planner``).
        quick: the smoke run (fewer repeats).
        plain: per size, the plain planner's rate in descriptors/s (the reference).

    Returns:
        One result per size, keyed ``planner_canonical_<small|medium|large>``.
    """
    results: list[Result] = []
    for which, size, reference in zip(("small", "medium", "large"), sizes.planner, plain, strict=True):
        planner, gpu_spec, cpu_spec = canonical_case(size)
        prepared = planner.prepare("store", gpu_spec, cpu_spec)
        n = prepared.num_ops
        out = tuple(np.zeros(n, dtype=np.int64) for _ in range(3))
        if which == "small":
            _check(planner, gpu_spec, cpu_spec)
        runs = 5 if quick else (200 if n <= 4096 else (30 if n <= 100_000 else 10))
        best = best_of(functools.partial(_plan, planner, gpu_spec, cpu_spec, out), runs)
        goal, conditions = (("none (fixed per-call cost dominates)", []) if which == "small" else
                            (f">= {GOAL_CANONICAL_VS_PLAIN:g}x plain (within 2x)",
                             [Goal("ratio", ">=", GOAL_CANONICAL_VS_PLAIN)]))
        results.append(result(
            f"planner_canonical_{which}", f"planner, canonical mode, {label(n)} descriptors",
            (n / best, "descriptors/s"),
            (reference, "descriptors/s", f"planner, plain mode, {label(size)} descriptors"),
            goal, conditions,
            note=f"TP=4 rank 1 of 8 KV heads, split NHD: 32 fragments per block and layer, {n} descriptors; "
                 f"{best * 1e3:.3f} ms per prepare + write"))
    return results
