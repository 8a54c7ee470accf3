"""The simulated device's cost model: the cost terms, the copy-path choice, and the shared PCIe link (the
named profiles are in ``sim_profiles``).

Theory of operation
-------------------
A :class:`CostProfile` prices one ``copy_batch``. ``"simple"`` (the default) is the historical model,
``latency + bytes / bandwidth`` with no path and no sharing; the sim then never builds a :class:`CostModel`.
Every other profile prices a copy in two phases:

1. *Fixed phase* (not on the link): ``call_cost`` + the path's ``launch`` + ``per_descriptor`` x descriptors (for
   the memcpy path: x contiguous runs, as the CuPy backend issues one ``cudaMemcpyAsync`` per run).
2. *Link phase*: the copy's bytes cross the link of its direction (``h2d`` = load, ``d2h`` = store). Alone it
   moves them at its *demand* rate, ``bytes / (pinned bytes / path bandwidth(mean descriptor size) + pageable
   bytes / pageable_bandwidth)``. All copies in the link phase share the links: per direction the rates are
   scaled down proportionally so they sum to at most that direction's link, then, if both directions together
   exceed ``bidirectional_bandwidth``, every rate is scaled by the same factor (full duplex up to that cap).
   *Per direction*: a load reads the path's ``load_bandwidth`` points and the profile's ``load_link_bandwidth``
   where they are set (a source measured the directions apart); everything else -- a store, a local copy, a
   load where they are None -- reads ``bandwidth`` and ``link_bandwidth`` (:meth:`PathCost.rate`,
   :meth:`CostProfile.link`, the one place each choice is made). Whenever a
   copy enters or leaves the link phase the progress of every other copy is settled and its finish time
   recomputed; a stale heap entry is skipped (:meth:`CostModel.settle`). Device-to-device and host-to-host
   copies do not use the link (they run at their demand rate).

That sharing is the profile's ``link_model``: ``"fair"`` (the default; every copy in its link phase shares its
direction's link). ``"fifo"`` puts one copy engine per direction in front of the link (``_simengine.py``): a copy
that ended its fixed phase waits for its engine, which serves one copy at a time in arrival order, one stream's
queued copies as a block; the copies served (at most one per direction) get their rates from the same rebalance
(demand, then the duplex cap).

The path is :func:`~kvoffload_ref.backends.copy_paths.choose_path` with the backend's ``copy_path`` and the
profile's thresholds; ``legal`` is "no host side outside a pinned range". A profile with a ``dma`` path (batched
DMA, e.g. ``cudaMemcpyBatchAsync``) takes it wherever the rule says memcpy. Compute work that starts while a
kernel-path copy is in flight (either phase) runs ``compute_slowdown`` times its delay (the kernel occupies SMs).

Everything is a float computed in a fixed order: deterministic, and O(copies in flight) per copy event.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Final, Literal

import numpy as np

from kvoffload_ref.backends._simengine import FifoEngines
from kvoffload_ref.backends._simsched import CopyOp, Op
from kvoffload_ref.backends._simsized import Plan
from kvoffload_ref.backends.copy_paths import (
    DEFAULT_KERNEL_MAX_MEAN_BYTES,
    DEFAULT_KERNEL_MIN_COUNT,
    I64,
    CopyPath,
    choose_path,
    run_starts,
)
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.validate import check_positive

__all__ = ["LINK_MODELS", "CostModel", "CostProfile", "Flow", "LinkModel", "PathCost", "PathName"]

PathName = Literal["memcpy", "kernel", "dma"]
LinkModel = Literal["fair", "fifo"]
#: The valid ``CostProfile.link_model`` values.
LINK_MODELS: Final[tuple[LinkModel, ...]] = ("fair", "fifo")
Direction = Literal["h2d", "d2h", "local"]


@dataclasses.dataclass(frozen=True)
class PathCost:
    """What one copy path costs.

    Attributes:
        launch: seconds per submission on this path, on top of the profile's ``call_cost`` (the kernel path:
            descriptor upload and launch).
        per_descriptor: seconds per descriptor (memcpy path: per contiguous run), not on the link.
        bandwidth: ``(descriptor bytes, effective bytes/s)`` points, sizes increasing; the rate at the batch's
            mean descriptor size is interpolated linearly in log(size) and clamped at both ends. Stores (and
            local copies) read these; loads too unless ``load_bandwidth`` is set.
        load_bandwidth: the points loads (``h2d``) read, in the same form, where a source measured the
            directions apart; None (the default): ``bandwidth`` for both directions.

    Raises:
        InvalidTransferError: a points tuple that is empty, has a size that is not an int > 0 or sizes not
            strictly increasing, or a rate that is not a finite number > 0.
    """

    launch: float
    per_descriptor: float
    bandwidth: tuple[tuple[int, float], ...]
    load_bandwidth: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        _check_points("bandwidth", self.bandwidth)
        if self.load_bandwidth is not None:
            _check_points("load_bandwidth", self.load_bandwidth)

    def rate(self, mean_size: float, direction: Direction) -> float:
        """Effective bytes/s at a mean descriptor size in one direction (see the class docstring).

        Args:
            mean_size: the batch's mean descriptor size in bytes.
            direction: ``"h2d"`` (a load: ``load_bandwidth`` where set), ``"d2h"`` or ``"local"`` (``bandwidth``).

        Returns:
            The interpolated rate, bytes/s.
        """
        points = self.load_bandwidth if direction == "h2d" and self.load_bandwidth is not None else self.bandwidth
        if len(points) == 1 or mean_size <= points[0][0]:
            return points[0][1]
        if mean_size >= points[-1][0]:
            return points[-1][1]
        x = math.log(mean_size)
        for (s0, b0), (s1, b1) in itertools.pairwise(points):
            if mean_size <= s1:
                f = (x - math.log(s0)) / (math.log(s1) - math.log(s0))
                return b0 + f * (b1 - b0)
        return points[-1][1]   # pragma: no cover - unreachable (clamped above)


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """A named set of cost terms (docs/simulator.md lists each profile's values and where they come from).

    Attributes:
        name: the profile's name.
        call_cost: seconds every ``copy_batch`` costs (for ``"simple"``: the whole latency).
        memcpy: the per-run ``cudaMemcpyAsync`` path.
        kernel: the gather/scatter kernel path, or None (the profile has no kernel: every copy is memcpy/dma).
        dma: a batched-DMA path replacing memcpy wherever the rule picks memcpy, or None.
        link_bandwidth: bytes/s of one direction's link, shared by every copy in flight in that direction (the
            store link; the load link too unless ``load_link_bandwidth`` is set). It also caps every path's rate.
        bidirectional_bandwidth: bytes/s both directions together may reach (full duplex up to this cap).
        pageable_bandwidth: bytes/s for the bytes of a host side outside every pinned range.
        compute_slowdown: factor on a compute work's delay when it starts while a kernel-path copy is in flight.
        kernel_min_count: ``auto``'s minimum descriptor count for the kernel (as the CuPy backend's).
        kernel_max_mean_bytes: ``auto``'s largest mean descriptor size for the kernel.
        shared_link: False only for ``"simple"``: no link phase, every copy alone on its own link.
        link_model: how copies in their link phase take the link: ``"fair"`` (the default: all share their
            direction's link, rates scaled proportionally) or ``"fifo"`` (one copy engine per direction, arrival
            order, one stream's queued copies as a block; ``_simengine.py``). Both apply the duplex cap.
        load_link_bandwidth: bytes/s of the load (``h2d``) link, where a source measured it apart from the
            store link; None (the default): ``link_bandwidth`` for both directions.

    Raises:
        InvalidTransferError: a ``link_model`` not in :data:`LINK_MODELS`, ``"fifo"`` without a shared link, or
            a ``load_link_bandwidth`` that is neither None nor a finite number > 0.
    """

    name: str
    call_cost: float
    memcpy: PathCost
    kernel: PathCost | None
    dma: PathCost | None
    link_bandwidth: float
    bidirectional_bandwidth: float
    pageable_bandwidth: float
    compute_slowdown: float = 1.0
    kernel_min_count: int = DEFAULT_KERNEL_MIN_COUNT
    kernel_max_mean_bytes: int = DEFAULT_KERNEL_MAX_MEAN_BYTES
    shared_link: bool = True
    link_model: LinkModel = "fair"
    load_link_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if self.load_link_bandwidth is not None:
            check_positive(f"CostProfile {self.name!r}: load_link_bandwidth", self.load_link_bandwidth,
                           unit="bytes per second")
        if self.link_model not in LINK_MODELS:
            raise InvalidTransferError(f"CostProfile {self.name!r}: link_model must be one of "
                                       f"{', '.join(map(repr, LINK_MODELS))}; got {self.link_model!r}")
        if self.link_model != "fair" and not self.shared_link:
            raise InvalidTransferError(f"CostProfile {self.name!r}: link_model {self.link_model!r} needs a shared "
                                       "link (shared_link=True); this profile has no link phase")

    def link(self, direction: Direction) -> float:
        """Bytes/s of one direction's link (see the class docstring).

        Args:
            direction: ``"h2d"`` (``load_link_bandwidth`` where set), ``"d2h"`` or ``"local"``
                (``link_bandwidth``).

        Returns:
            The link's bytes/s.
        """
        if direction == "h2d" and self.load_link_bandwidth is not None:
            return self.load_link_bandwidth
        return self.link_bandwidth

    def path_rate(self, cost: PathCost, mean_size: float, direction: Direction) -> float:
        """Bytes/s a copy on path ``cost`` moves alone at a mean descriptor size: the path's rate, capped by its
        direction's link (the link phase's demand rate for pinned bytes).

        Args:
            cost: one of this profile's paths.
            mean_size: the batch's mean descriptor size in bytes.
            direction: ``"h2d"``, ``"d2h"`` or ``"local"`` (see :meth:`PathCost.rate`, :meth:`link`).

        Returns:
            The rate, bytes/s.
        """
        return min(cost.rate(mean_size, direction), self.link(direction))


def _check_points(name: str, points: object) -> None:
    """Refuse a bandwidth points tuple :meth:`PathCost.rate` could not read (see :class:`PathCost`)."""
    if not isinstance(points, tuple) or not points:
        raise InvalidTransferError(f"PathCost {name} must be a non-empty tuple of (bytes, bytes/s) points; "
                                   f"got {points!r}")
    last = 0
    for point in points:
        size = point[0] if isinstance(point, tuple) and len(point) == 2 else None
        if not isinstance(size, int) or isinstance(size, bool) or size <= last:
            raise InvalidTransferError(f"PathCost {name}: each point is (bytes, bytes/s), sizes ints > 0 and "
                                       f"strictly increasing; got {point!r} in {points!r}")
        check_positive(f"PathCost {name} at {size} bytes", point[1], unit="bytes per second")
        last = size


class Flow:
    """One priced copy: its path, its phase and, in the link phase, its progress."""

    __slots__ = ("bytes", "count", "demand", "direction", "due", "link", "path", "rate", "remaining", "since",
                 "waited")

    def __init__(self, path: PathName, direction: Direction, nbytes: int, count: int, demand: float) -> None:
        self.path, self.direction, self.bytes, self.count, self.demand = path, direction, nbytes, count, demand
        # Invariant: False in the fixed phase, True once in the link phase (then in CostModel._active, or under
        # "fifo" waiting for its engine: rate 0, due +inf, no heap entry).
        self.link = False
        # Invariant: in the link phase, bytes left at ``since`` moving at ``rate``; ``due`` the finish time of
        # the heap entry that is current (every other entry of this op is stale).
        self.remaining, self.rate, self.since, self.due = float(nbytes), 0.0, 0.0, math.inf
        # Invariant: the seconds it waited for its copy engine ("fifo"; set when served, else 0.0); while it
        # waits, ``since`` is when it arrived.
        self.waited = 0.0


class CostModel:
    """Prices copies under a profile and runs the shared link (see the module docstring).

    Args:
        profile: the cost terms.
        push: ``push(op, t)`` puts a heap entry for ``op`` finishing at ``t`` (the scheduler's heap).
    """

    def __init__(self, profile: CostProfile, push: Callable[[Op, float], None]) -> None:
        # Invariant: the terms every price uses; never changes.
        self.profile = profile
        # Invariant: the scheduler's heap insertion (an op may have several entries; only its Flow.due is live).
        self._push = push
        # Invariant: the flows moving bytes on the link, in the order they began to (under "fifo": the copies the
        # engines serve, at most one per direction; a copy waiting for its engine is in the link phase, not here).
        self._active: list[tuple[CopyOp, Flow]] = []
        # Invariant: how many kernel-path copies are in flight (either phase).
        self._kernels = 0
        # Invariant: None under "fair"; under "fifo" the two copy engines (which copy each serves, and when).
        self._engines = FifoEngines() if profile.link_model == "fifo" else None

    def price(self, op: CopyOp, plan: Plan, slow: int, copy_path: CopyPath, seams: I64 | None = None) -> float:
        """Choose the copy's path (``copy_path``: the backend's setting), attach its :class:`Flow` and return its
        fixed phase's duration (or, for a copy that does not use the link, its whole duration). ``seams``: where
        registrations begin and end (the memcpy path's runs never cross one, R25, as on the CuPy backend)."""
        p = self.profile
        sizes = plan.sizes
        live = sizes > 0
        count = int(np.count_nonzero(live))
        total = int(sizes[live].sum()) if count else 0
        path: PathName = choose_path(copy_path if p.kernel is not None else "memcpy", count=count,
                                     total_bytes=total, legal=slow == 0, min_count=p.kernel_min_count,
                                     max_mean_bytes=p.kernel_max_mean_bytes)
        if path == "memcpy" and p.dma is not None:
            path = "dma"
        cost = p.kernel if path == "kernel" else p.dma if path == "dma" else p.memcpy
        assert cost is not None   # Invariant: the kernel path is chosen only when the profile has one
        units = count if path != "memcpy" or count <= 1 else \
            int(run_starts(plan.src[live], plan.dst[live], sizes[live], seams).size)
        fixed = p.call_cost + cost.launch + cost.per_descriptor * units
        direction: Direction = "local"
        if count:
            first = int(np.argmax(live))
            si, di = int(plan.si[first]), int(plan.di[first])
            src_host = si >= 0 and plan.spans[si].is_host
            dst_host = di >= 0 and plan.spans[di].is_host
            direction = "d2h" if dst_host and not src_host else "h2d" if src_host and not dst_host else "local"
        rate = p.path_rate(cost, total / count if count else 1, direction)
        link_time = (total - min(slow, total)) / rate + slow / p.pageable_bandwidth
        flow = Flow(path, direction, total, count, total / link_time if link_time > 0 else math.inf)
        op.flow = flow
        if path == "kernel":
            self._kernels += 1
        if self._engines is not None:   # an engine held for this copy is released if it will not arrive there
            instead = self._engines.priced(op, "local" if total == 0 else direction)
            if instead is not None:
                self._serve(instead[0], instead[1])
        if direction == "local" or total == 0:   # no link phase: finish after the fixed phase and the bytes
            flow.link = True
            flow.due = math.nan   # never in _active; settle finishes it at its first entry
            return fixed + link_time
        return fixed

    def settle(self, op: Op, t: float) -> bool:
        """Whether the heap entry ``(t, op)`` is the op's finish; else it started the op's link phase or was stale."""
        if op.__class__ is not CopyOp:
            return True
        flow = op.flow
        if not isinstance(flow, Flow):
            return True
        if not flow.link:
            flow.link, flow.since = True, t
            if self._engines is None:
                self._serve(op, t)
                return False
            served, displaced = self._engines.arrive(op, flow.direction, t)
            if displaced is not None:   # began at t too, submitted later: back to the queue, no bytes moved
                gone = displaced.flow
                assert isinstance(gone, Flow)
                self._active.remove((displaced, gone))
                gone.rate, gone.due = 0.0, math.inf
            if served:
                self._serve(op, t)
            return False
        if flow.due != t and not math.isnan(flow.due):
            return False
        if not math.isnan(flow.due):
            self._active.remove((op, flow))
            nxt = None if self._engines is None else self._engines.finish(op, flow.direction, t)
            if nxt is None:
                self._rebalance(t, None)
            else:
                self._serve(nxt, t)
        flow.due = -math.inf   # finished: any later entry of this op is stale
        if flow.path == "kernel":
            self._kernels -= 1
        return True

    def _serve(self, op: CopyOp, t: float) -> None:
        """``op``'s bytes start moving at ``t`` (it joins the link's rates)."""
        flow = op.flow
        assert isinstance(flow, Flow)   # Invariant: a copy in the link phase was priced
        flow.waited, flow.since = t - flow.since, t
        self._active.append((op, flow))
        self._rebalance(t, flow)

    def compute_factor(self) -> float:
        """The factor on a compute work starting now (``compute_slowdown`` while a kernel copy is in flight)."""
        return self.profile.compute_slowdown if self._kernels else 1.0

    def _rebalance(self, t: float, joined: Flow | None) -> None:
        p = self.profile
        demand: dict[Direction, float] = {"h2d": 0.0, "d2h": 0.0}
        for _, f in self._active:
            f.remaining = max(0.0, f.remaining - f.rate * (t - f.since))
            f.since = t
            demand[f.direction] += f.demand
        scale = {d: min(1.0, p.link(d) / v) if v > 0 else 1.0 for d, v in demand.items()}
        both = sum(v * scale[d] for d, v in demand.items())
        duplex = min(1.0, p.bidirectional_bandwidth / both) if both > 0 else 1.0
        for op, f in self._active:
            rate = f.demand * scale[f.direction] * duplex
            if rate != f.rate or f is joined:
                f.rate = rate
                f.due = t + f.remaining / rate
                self._push(op, f.due)

    def in_flight(self) -> int:
        """How many copies move bytes on the link (for tests; under "fifo" at most one per direction)."""
        return len(self._active)

    def waiting(self) -> int:
        """How many copies wait for a copy engine (for tests; always 0 under "fair")."""
        return 0 if self._engines is None else self._engines.waiting()
