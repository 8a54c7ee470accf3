"""Bench figures of the sim's cost model: the GPU benchmark's own schedules on ``SimBackend(profile="h200")``
against the figures recorded on an H200, and the data path's cost with a profile on.

*Calibration* (``calibration_<page>_<direction>``): ``scripts/gpu_bench.py``'s main schedules, replayed on the sim:
a scattered transfer of 4 KiB x 16384, 64 KiB x 4096 and 1 MiB x 256 pages (GPU block i <-> pinned host slot
perm[i], a random permutation), store and load, each timed between two events on one stream around one
submission: ``contiguous`` (one descriptor of all the bytes), ``kernel`` and ``memcpy`` (``copy_path`` forced),
``auto``. The modelled GB/s of each path is divided by the figure recorded in docs/gpu-check.json
(:data:`RECORDED_H200`, the same numbers); the goal is every ratio within 0.85-1.15. Each schedule runs one copy at a
time on one stream, so the link models (``"fair"``, the profile's, and ``"fifo"``) price it alike: the bench runs the
profile's; ``tests/test_backends_sim_cost.py`` holds both to the goal. These figures are on the virtual clock: the
same on every machine. The quick run replays a quarter of the pages of each schedule. The Python loop of one
``cudaMemcpyAsync`` per page is not a ``copy_batch`` schedule and is not replayed (the memcpy path is the same
calls, issued by the backend).

*Profile cost* (``profile_cost_4k``): the data-path round trip of ``bench.datapath`` (4 KiB pages) on
``profile="h200"`` against the default ``"simple"`` profile, real time, alternately; goal >= 0.9x.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from kvoffload_ref.backends._simcost import LinkModel
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.bench.common import BenchRun, Goal, KiB, MiB, Result, result
from kvoffload_ref.bench.datapath import data_path_rig, round_trip

__all__ = ["PATHS", "RECORDED_H200", "SCHEDULES", "calibration_ratios", "figures", "sim_gbps"]

#: (page bytes, pages) of gpu_bench.py's main comparison (256 MiB per transfer, a quarter of it at 4 KiB).
SCHEDULES: Final = ((4 * KiB, 16384), (64 * KiB, 4096), (MiB, 256))
#: The quick run's schedules: a quarter of the pages (fixed costs weigh a little more: ratios a few % lower).
QUICK_SCHEDULES: Final = tuple((page, count // 4) for page, count in SCHEDULES)
#: The copy_batch paths compared.
PATHS: Final = ("contiguous", "kernel", "memcpy", "auto")

#: GB/s recorded on an H200 by scripts/gpu_bench.py (docs/gpu-check.json, "main"), by (page, direction, path).
RECORDED_H200: Final[dict[tuple[int, str], dict[str, float]]] = {
    (4 * KiB, "store"): {"contiguous": 55.094, "kernel": 46.552, "memcpy": 1.640, "auto": 46.242},
    (4 * KiB, "load"): {"contiguous": 55.233, "kernel": 46.688, "memcpy": 1.466, "auto": 45.393},
    (64 * KiB, "store"): {"contiguous": 55.125, "kernel": 50.885, "memcpy": 17.391, "auto": 50.612},
    (64 * KiB, "load"): {"contiguous": 55.181, "kernel": 49.740, "memcpy": 16.143, "auto": 49.701},
    (MiB, "store"): {"contiguous": 55.111, "kernel": 50.837, "memcpy": 47.720, "auto": 50.782},
    (MiB, "load"): {"contiguous": 55.257, "kernel": 49.960, "memcpy": 46.662, "auto": 49.949},
}
LOW, HIGH = 0.85, 1.15


def sim_gbps(page: int, count: int, profile: str = "h200", seed: int = 0,
             link_model: LinkModel | None = None) -> dict[str, dict[str, float]]:
    """Modelled GB/s of every path of one gpu_bench schedule, both directions, on a fresh sim (virtual clock).

    Args:
        page: bytes per page.
        count: pages.
        profile: the sim profile.
        seed: the permutation's seed.
        link_model: None (the profile's), ``"fair"`` or ``"fifo"``.

    Returns:
        direction (``"store"``: GPU -> pinned host, ``"load"``) -> path -> GB/s.
    """
    be = SimBackend(profile=profile, race_check=False, link_model=link_model)
    nbytes = page * count
    dev = be.empty_device((count, page))
    host = np.zeros(nbytes, np.uint8)
    hptr = int(host.ctypes.data)
    be.track_host(hptr, nbytes)
    be.host_register(hptr, nbytes)
    g = be.array_info(dev)
    perm = np.random.default_rng(seed).permutation(count).astype(np.int64)
    ids = np.arange(count, dtype=np.int64)
    dev_addr, host_addr = g.ptr + ids * page, hptr + perm * page
    buf, one = be.alloc_descriptors(count), be.alloc_descriptors(1)
    stream, start, end = be.create_stream(), be.create_event(), be.create_event()
    out: dict[str, dict[str, float]] = {}
    for direction in ("store", "load"):
        src, dst = (dev_addr, host_addr) if direction == "store" else (host_addr, dev_addr)
        buf.fill(src, dst, np.full(count, page, np.int64))
        c_src, c_dst = (g.ptr, hptr) if direction == "store" else (hptr, g.ptr)
        one.fill(np.array([c_src], np.int64), np.array([c_dst], np.int64), np.array([nbytes], np.int64))
        row = out[direction] = {}
        for path in PATHS:
            be.copy_path = "auto" if path in ("contiguous", "auto") else path  # type: ignore[assignment]
            be.record(start, stream)
            be.copy_batch(stream, one, 1, tag=(direction, 0)) if path == "contiguous" else \
                be.copy_batch(stream, buf, count, tag=(direction, 0))
            be.record(end, stream)
            be.synchronize(end)
            row[path] = nbytes / be.elapsed(start, end) / 1e9
    be.untrack_host(hptr)   # the copies are done (synchronized): nothing is under DMA
    return out


def calibration_ratios(profile: str = "h200", schedules: tuple[tuple[int, int], ...] = SCHEDULES,
                       link_model: LinkModel | None = None) -> dict[tuple[int, str], dict[str, float]]:
    """Modelled / recorded GB/s for every schedule, direction and path (see the module docstring); ``link_model``:
    None (the profile's), ``"fair"`` or ``"fifo"``."""
    ratios: dict[tuple[int, str], dict[str, float]] = {}
    for page, count in schedules:
        for direction, modelled in sim_gbps(page, count, profile, link_model=link_model).items():
            recorded = RECORDED_H200[(page, direction)]
            ratios[(page, direction)] = {p: modelled[p] / recorded[p] for p in PATHS}
    return ratios


def _calibration(quick: bool) -> list[Result]:
    results = []
    schedules = QUICK_SCHEDULES if quick else SCHEDULES
    counts = dict(schedules)
    for (page, direction), ratios in calibration_ratios(schedules=schedules).items():
        recorded = RECORDED_H200[(page, direction)]["auto"]
        base = result(
            f"calibration_{page // KiB}k_{direction}",
            f"sim h200 model vs H200, {page // KiB} KiB x {counts[page]} {direction}, auto path",
            (ratios["auto"] * recorded * 1e9, "bytes/s"), (recorded * 1e9, "bytes/s", "recorded on an H200"),
            f"every path {LOW}..{HIGH}x", [Goal("ratio", ">=", LOW), Goal("ratio", "<=", HIGH)],
            note="modelled/recorded per path (virtual clock): " + ", ".join(f"{p} {r:.3f}" for p, r in ratios.items()))
        met = all(LOW <= r <= HIGH for r in ratios.values())
        results.append(Result(**{**base.__dict__, "met": met}))
    return results


def _profile_cost(run: BenchRun) -> Result:
    """The 4 KiB data-path round trip with profile h200 against the simple profile, alternately."""
    sizes = run.sizes
    rigs = {name: data_path_rig(4 * KiB, sizes.datapath_bytes, sizes.job_blocks,
                                backend=SimBackend(profile=name)) for name in ("simple", "h200")}
    best = dict.fromkeys(rigs, math.inf)
    try:
        for attempt in range(sizes.repeats + 1):
            for name, rig in rigs.items():
                elapsed = round_trip(rig)  # real seconds
                if attempt:
                    best[name] = min(best[name], elapsed)
    finally:
        for rig in rigs.values():
            rig.worker.shutdown()
    moved = 2 * int(rigs["h200"].store_rows.size) * 4 * KiB * 32
    return result("profile_cost_4k", f"sim data path with profile h200, 4 KiB pages, store+load {moved // MiB} MiB",
                  (moved / best["h200"], "bytes/s"), (moved / best["simple"], "bytes/s", "the same, profile simple"),
                  ">= 0.9x", [Goal("ratio", ">=", 0.9)],
                  note="real time; the cost model (paths, shared link) must stay cheap")


def figures(run: BenchRun) -> list[Result]:
    """The cost-model figure group: ``calibration_<4k|64k|1024k>_<store|load>``, ``profile_cost_4k``."""
    return [*_calibration(run.quick), _profile_cost(run)]
