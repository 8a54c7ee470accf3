"""The simulated device's named cost profiles, each with its provenance: which values were measured, by whom, on
which shapes, and which are assumed (and taken from which other profile).

A profile (:class:`~kvoffload_ref.backends._simcost.CostProfile`) prices one ``copy_batch``: a per-call cost, per
copy path a per-descriptor cost and effective bandwidth by descriptor size, a link per direction and a duplex cap
(docs/simulator.md, "Cost profiles"). Only ``"h200"`` is *measured here* (fitted to docs/gpu-check.json by
``kvoffload_ref/bench/calibration.py``); ``"h100"``, ``"mi300x"``, ``"mi355x"``, ``"gb200"`` and ``"h20"`` are
*from published figures*, and ``"simple"`` is the historical round-number model. Every value that no figure
supports is listed in its profile's :attr:`Provenance.assumed`.

Where a source gives end-to-end GB/s by descriptor size for many descriptors (vLLM #42212, ROCm/clr #273), the
path has no per-descriptor term and its bandwidth points are those GB/s (the sim reads them at the batch's mean
descriptor size). Where it gives a time per entry (vLLM #40549, torchcomms #2195), that time is the
per-descriptor term. Where a source measured the two directions apart (kvcached #450, ROCm/clr #273), a path's
``load_bandwidth`` points and the profile's ``load_link_bandwidth`` hold the loads' (H2D) figures and the other
terms the stores' (D2H); where it gives one direction or does not say which, both directions get its values and
:attr:`Provenance.assumed` says so.

The paths: ``memcpy`` is one ``cudaMemcpyAsync``/``hipMemcpyAsync`` per contiguous run (the per-op loop; this
project's CuPy backend); ``dma`` is one batched submission (``cudaMemcpyBatchAsync``/``hipMemcpyBatchAsync``),
which the sim takes wherever the path rule says memcpy; ``kernel`` is a gather/scatter kernel.
:func:`path_variant` gives the profile and ``copy_path`` setting that force one of them (the cost table and the
tests price each path that way).
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

from kvoffload_ref.backends._simcost import CostProfile, PathCost, PathName
from kvoffload_ref.backends.copy_paths import CopyPath

__all__ = ["GB200", "H20", "H100", "H200", "MI300X", "MI355X", "PROFILES", "PROVENANCE", "SIMPLE", "Provenance",
           "path_variant", "paths_of", "profile_named"]

GB: Final = 1e9
KiB: Final = 1024
MiB: Final = 1024 * 1024
Kind = Literal["measured here", "from published figures", "historical model"]


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a profile's values come from.

    Attributes:
        kind: ``"measured here"`` (fitted to this project's own GPU run), ``"from published figures"`` or
            ``"historical model"`` (round numbers, no source).
        sources: the published sources (or this project's file) the values come from, by public name.
        fitted_on: the shapes the values were fitted on (direction, descriptor size and count, path).
        assumed: each value no figure supports, and the profile or reason it was taken from.
    """

    kind: Kind
    sources: tuple[str, ...]
    fitted_on: tuple[str, ...]
    assumed: tuple[str, ...]


#: This project's CuPy backend's call overhead and per-run cudaMemcpyAsync cost, measured on the H200's host.
_CALL: Final = 14e-6
_RUN: Final = 2.57e-6

#: The historical model: 5 us + bytes / 25 GB/s pinned (8 GB/s pageable), no paths, no sharing.
SIMPLE: Final = CostProfile("simple", 5e-6, PathCost(0.0, 0.0, ((1, 25 * GB),)), None, None,
                            25 * GB, 50 * GB, 8 * GB, shared_link=False)

#: Fitted to docs/gpu-check.json (an H200 over PCIe Gen5 x16, CuPy backend, scattered pages; see the docs).
H200: Final = CostProfile(
    "h200", call_cost=_CALL,
    memcpy=PathCost(0.0, _RUN, ((4 * KiB, 55.2 * GB),)),
    kernel=PathCost(29e-6, 0.0, ((4 * KiB, 48.05 * GB), (64 * KiB, 50.7 * GB), (MiB, 50.8 * GB))),
    dma=None,
    link_bandwidth=55.2 * GB, bidirectional_bandwidth=83.4 * GB, pageable_bandwidth=8 * GB,
    compute_slowdown=1.06)

#: From vLLM's published H100 figures (blog 2026-01-08, PRs #42212 and #48434; see the docs): batched DMA.
H100: Final = CostProfile(
    "h100", call_cost=_CALL,
    memcpy=PathCost(0.0, _RUN, ((4 * KiB, 50 * GB),)),
    kernel=PathCost(29e-6, 0.0, ((4 * KiB, 35 * GB), (2 * MiB, 50 * GB))),
    # the ~0.5 us of CPU per descriptor (#48434) overlaps the DMA: #42212's GB/s are end to end, so no extra term
    dma=PathCost(0.0, 0.0, ((4 * KiB, 3.8 * GB), (24 * KiB, 7 * GB), (28 * KiB, 42 * GB),
                               (64 * KiB, 52 * GB))),
    link_bandwidth=52 * GB, bidirectional_bandwidth=83.4 * GB, pageable_bandwidth=8 * GB,
    compute_slowdown=1.06)


def _same_time(profile: CostProfile, sizes: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
    """End-to-end bandwidth points at ``sizes`` that price one descriptor as ``profile``'s memcpy path prices it
    alone: its per-descriptor term plus its bytes at the rate the profile gives a store on that path
    (:meth:`CostProfile.path_rate`; for a path with one set of points)."""
    path = profile.memcpy
    return tuple((s, s / (path.per_descriptor + s / profile.path_rate(path, s, "d2h"))) for s in sizes)


#: MI355X (gfx950, ROCm 7.13), ROCm/clr #273, D2H with srcAccessOrder=ANY, GB/s per descriptor size.
_MI355X_PER_OP: Final = ((4 * KiB, 1.7 * GB), (16 * KiB, 6.6 * GB), (64 * KiB, 6.3 * GB), (256 * KiB, 18 * GB),
                         (MiB, 37 * GB))
_MI355X_BATCHED: Final = ((4 * KiB, 1.7 * GB), (16 * KiB, 6.7 * GB), (64 * KiB, 4.1 * GB), (256 * KiB, 30 * GB),
                          (MiB, 52 * GB))
#: The same, H2D (the loads): batched is slower than per-op from 16 KiB on (3.8 vs 5.7 GB/s at 64 KiB).
_MI355X_PER_OP_H2D: Final = ((4 * KiB, 1.6 * GB), (16 * KiB, 6.1 * GB), (64 * KiB, 5.7 * GB),
                             (256 * KiB, 17.8 * GB), (MiB, 37 * GB))
_MI355X_BATCHED_H2D: Final = ((4 * KiB, 1.7 * GB), (16 * KiB, 5.7 * GB), (64 * KiB, 3.8 * GB),
                              (256 * KiB, 12.8 * GB), (MiB, 30 * GB))
#: The MI355X's largest measured rate (batched D2H at 1 MiB): its link, and the MI300X's (assumed).
_AMD_LINK: Final = 52 * GB

MI355X: Final = CostProfile(
    "mi355x", call_cost=_CALL,
    memcpy=PathCost(0.0, 0.0, _MI355X_PER_OP, load_bandwidth=_MI355X_PER_OP_H2D),
    kernel=None,
    # batched is *slower* than per-op at 64 KiB (D2H 4.1 vs 6.3 GB/s, H2D 3.8 vs 5.7)
    dma=PathCost(0.0, 0.0, _MI355X_BATCHED, load_bandwidth=_MI355X_BATCHED_H2D),
    link_bandwidth=_AMD_LINK, bidirectional_bandwidth=83.4 * GB, pageable_bandwidth=8 * GB)

#: MI300X, vLLM #40549: 4,096 entries of 4-8 KB (fitted at 6 KiB): per-op loop 22.4 ms, batched 10.5 ms, in all.
_MI300X_ENTRIES: Final = 4096
_MI300X_LOOP: Final = PathCost(0.0, (22.4e-3 - _CALL) / _MI300X_ENTRIES - 6 * KiB / _AMD_LINK,
                               ((4 * KiB, _AMD_LINK),))
_MI300X_BATCHED_ENTRY: Final = (10.5e-3 - _CALL) / _MI300X_ENTRIES   # ~2.56 us per entry, flat over 4-8 KiB

_MI300X_LOOP_ONLY: Final = CostProfile(
    "mi300x", call_cost=_CALL,
    memcpy=_MI300X_LOOP,
    kernel=None,
    dma=None,
    link_bandwidth=_AMD_LINK, bidirectional_bandwidth=83.4 * GB, pageable_bandwidth=8 * GB)

MI300X: Final = dataclasses.replace(
    _MI300X_LOOP_ONLY,
    # batched: ~2.56 us per 4-8 KiB entry; from 32 KiB on no gain over the loop (#40549), so the same time as it
    dma=PathCost(0.0, 0.0, tuple((s, s / _MI300X_BATCHED_ENTRY) for s in (4 * KiB, 6 * KiB, 8 * KiB))
                 + _same_time(_MI300X_LOOP_ONLY, (32 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB))))

#: GB200 (Grace), torchcomms #2195: one multi-request put (1 B-64 KB) by a cudaMemcpyAsync loop 3.36 us, by
#: cudaMemcpyBatchAsync 3.15 us; on an x86 H100 3.55 us. Per copy: the loop's cost is h100's scaled by 3.36/3.55,
#: the batched submission's 3.15/3.36 of it (batching saves ~6 %, against 35 % on the H100).
_GB200_LOOP: Final = PathCost(0.0, _RUN * 3.36 / 3.55, H100.memcpy.bandwidth)

GB200: Final = CostProfile(
    "gb200", call_cost=_CALL,
    memcpy=_GB200_LOOP,
    kernel=None,
    dma=dataclasses.replace(_GB200_LOOP, per_descriptor=_GB200_LOOP.per_descriptor * 3.15 / 3.36),
    link_bandwidth=H100.link_bandwidth, bidirectional_bandwidth=H100.bidirectional_bandwidth,
    pageable_bandwidth=8 * GB)

#: H20 (PCIe Gen5), kvcached #450 and agentic-kvc's pcie.json: large contiguous copies ~54 GB/s H2D, ~50 D2H.
_H20_STORE: Final = 50 * GB
_H20_LOAD: Final = 54 * GB

H20: Final = CostProfile(
    "h20", call_cost=_CALL,
    memcpy=PathCost(0.0, _RUN, ((4 * KiB, _H20_STORE),), load_bandwidth=((4 * KiB, _H20_LOAD),)),
    kernel=H200.kernel,
    dma=None,
    link_bandwidth=_H20_STORE, load_link_bandwidth=_H20_LOAD, bidirectional_bandwidth=83.4 * GB,
    pageable_bandwidth=8 * GB, compute_slowdown=1.06)

_ASSUMED_HOST = "call_cost 14 us and the memcpy path's 2.57 us per run: h200's (this project's CuPy backend)"
_ASSUMED_PAGEABLE = "pageable_bandwidth 8 GB/s: simple's (not measured)"
_ASSUMED_DUPLEX = "bidirectional_bandwidth 83.4 GB/s: h100's (vLLM blog, PCIe Gen5 x16 DMA)"

#: Every named profile's provenance, by profile name.
PROVENANCE: Final[dict[str, Provenance]] = {
    "simple": Provenance(
        "historical model", (), (),
        ("every value: round numbers (5 us + bytes / 25 GB/s pinned, 8 GB/s pageable), no paths, no sharing",)),
    "h200": Provenance(
        "measured here", ("docs/gpu-check.json (scripts/gpu_bench.py on an H200, PCIe Gen5 x16, CuPy backend)",),
        ("store and load, scattered 4 KiB x 16384, 64 KiB x 4096, 1 MiB x 256; contiguous, kernel, memcpy, auto",
         "the memcpy crossover (call_cost, per run) and the kernel crossover floor"),
        (_ASSUMED_DUPLEX + " (not measured on the H200)", _ASSUMED_PAGEABLE,
         "compute_slowdown 1.06: h100's (vLLM blog)")),
    "h100": Provenance(
        "from published figures",
        ("vLLM blog 2026-01-08 (KV offloading connector)", "vLLM #42212", "vLLM #48434", "NVIDIA/nvbandwidth #24"),
        ("batched DMA, small pages, N >= 50k: 3.8-7 GB/s at 4-24 KiB, 42 at 28 KiB, 52 at 64 KiB (#42212)",
         "large contiguous pinned copies ~50 GB/s, bidirectional 83.4 GB/s on 2 MB blocks (blog)",
         "SM copy kernel H2D 35 GB/s (nvbandwidth #24)"),
        (_ASSUMED_HOST, "the kernel path's 29 us launch: h200's", _ASSUMED_PAGEABLE)),
    "mi300x": Provenance(
        "from published figures", ("vLLM #40549",),
        ("4,096 scattered entries of 6 KiB (the source: 4-8 KB): per-op loop 22.4 ms in all (memcpy), batched "
         "10.5 ms (dma)", "no gain from batching at >= 32 KB (dma priced as memcpy from 32 KiB on)"),
        ("link and memcpy bandwidth 52 GB/s: mi355x's (ROCm/clr #273, batched D2H at 1 MiB); the source gives "
         "no bandwidth, so the level of both paths from 32 KiB on is this assumption", _ASSUMED_DUPLEX,
         "call_cost 14 us: h200's (the fit puts the rest of each entry's time in the per-entry terms)",
         _ASSUMED_PAGEABLE, "no kernel path (no published figure)",
         "the same values for both directions (the source does not say which it measured)")),
    "mi355x": Provenance(
        "from published figures", ("ROCm/clr #273",),
        ("D2H (srcAccessOrder=ANY) and H2D, per-op hipMemcpyAsync (memcpy) and hipMemcpyBatchAsync (dma): 4 KiB, "
         "16 KiB, 64 KiB, 256 KiB, 1 MiB (the source's descriptor counts are not stated; fitted as end-to-end "
         "GB/s, each direction to its own figures)",),
        ("link 52 GB/s: the largest figure (batched D2H at 1 MiB)",
         "the load link: the store link's 52 GB/s (#273's largest H2D figure, 37 GB/s per-op at 1 MiB, is below "
         "it; no figure says the H2D link is slower)", _ASSUMED_DUPLEX,
         "call_cost 14 us: h200's", _ASSUMED_PAGEABLE, "no kernel path (no published figure)",
         "a contiguous run is priced at its descriptors' size (the figures are per descriptor)")),
    "gb200": Provenance(
        "from published figures", ("meta-pytorch/torchcomms #2195",),
        ("latency of one multi-request put, 1 B-64 KB (GPU to GPU over NVLink): cudaMemcpyAsync loop 3.36 us, "
         "cudaMemcpyBatchAsync 3.15 us on GB200; loop 3.55 us on an x86 H100 (memcpy and dma per descriptor)",),
        ("no public GB200 host<->GPU KV block figures exist: every bandwidth (paths 50 GB/s, link 52, duplex "
         "83.4) is h100's PCIe Gen5 figure, likely far below GB200's NVLink-C2C",
         "the per-copy costs come from GPU-to-GPU puts, applied to host<->GPU copies",
         "call_cost 14 us: h200's", _ASSUMED_PAGEABLE, "no kernel path (no published figure)")),
    "h20": Provenance(
        "from published figures", ("kvcached #450", "agentic-kvc pcie.json"),
        ("large contiguous copies (100 MB-6.4 GB): ~54 GB/s H2D (the load link and memcpy bandwidth), ~50 GB/s "
         "D2H (the store link and memcpy bandwidth)",),
        (_ASSUMED_HOST, "the kernel path: h200's (launch 29 us, 48-51 GB/s, both directions; under the 50 GB/s "
         "store link its stores run at most 50 GB/s, from ~31 KiB descriptors on)",
         _ASSUMED_DUPLEX, _ASSUMED_PAGEABLE, "compute_slowdown 1.06: h100's (vLLM blog)")),
}

#: Every named profile.
PROFILES: Final[dict[str, CostProfile]] = {p.name: p for p in (SIMPLE, H200, H100, MI300X, MI355X, GB200, H20)}


def profile_named(profile: str | CostProfile) -> CostProfile:
    """A profile by name (or a :class:`CostProfile` as is).

    Args:
        profile: a key of :data:`PROFILES` or a profile.

    Returns:
        The profile.

    Raises:
        ValueError: an unknown name (it is what ``InvalidTransferError`` derives from too).
    """
    if isinstance(profile, CostProfile):
        return profile
    found = PROFILES.get(profile) if isinstance(profile, str) else None
    if found is None:
        raise ValueError(f"unknown sim profile {profile!r}; expected one of {', '.join(map(repr, PROFILES))} "
                         "or a CostProfile")
    return found


def paths_of(profile: CostProfile) -> tuple[PathName, ...]:
    """The copy paths a profile prices: ``memcpy`` always (the per-op loop), then ``kernel`` and ``dma`` where it
    has them.

    Args:
        profile: the profile.

    Returns:
        The path names, in that order.
    """
    names: list[PathName] = ["memcpy"]
    if profile.kernel is not None:
        names.append("kernel")
    if profile.dma is not None:
        names.append("dma")
    return tuple(names)


def path_variant(profile: CostProfile, path: PathName) -> tuple[CostProfile, CopyPath]:
    """The profile and the backend's ``copy_path`` setting under which every copy with a pinned host side takes
    ``path``: ``memcpy`` is the profile without its batched-DMA path (what a backend without one pays, e.g. this
    project's CuPy backend); ``dma`` takes the memcpy rule, which the profile's DMA path replaces.

    Args:
        profile: the profile.
        path: one of :func:`paths_of` ``(profile)``.

    Returns:
        ``(profile, copy_path)`` to build a sim with.

    Raises:
        ValueError: the profile has no such path.
    """
    if path not in paths_of(profile):
        raise ValueError(f"profile {profile.name!r} has no {path!r} path; it has {', '.join(paths_of(profile))}")
    if path == "memcpy":
        return dataclasses.replace(profile, dma=None), "memcpy"
    return profile, "kernel" if path == "kernel" else "memcpy"
