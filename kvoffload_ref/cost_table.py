"""``kvoffload-ref cost-table``: what one ``copy_batch`` costs under a sim profile, measured on the simulated
device, as a table a serving simulator can read (docs/cost-table.md describes every field).

Every time in the table is read off the sim's virtual clock (``elapsed`` between two events around the copy): the
profile's cost model prices it, nothing here re-derives a formula. Each copy runs alone on an idle device (one
``SimBackend`` per path and descriptor size, copies one after another): ``count`` descriptors of ``size`` bytes,
each its own contiguous run (the host side in reverse order), the host side pinned, forced onto one path
(:func:`~kvoffload_ref.backends.sim_profiles.path_variant`). The duplex rows run a store and a load together, on
disjoint rows, against each alone.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Iterable, Iterator
from typing import Any, Final, Literal

import numpy as np

from kvoffload_ref.backends._simcost import CostProfile, PathName
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.sim_profiles import PROFILES, PROVENANCE, path_variant, paths_of, profile_named

__all__ = ["CSV_COLUMNS", "DEFAULT_COUNTS", "DEFAULT_MAX_BYTES", "DEFAULT_SIZES", "SCHEMA_VERSION", "CopyRig",
           "build", "to_csv", "to_json"]

#: Bumped whenever a field is renamed, removed or changes meaning (adding a field keeps it).
SCHEMA_VERSION: Final = 1
KiB: Final = 1024
#: Descriptor sizes: 1 KiB .. 4 MiB, powers of 2.
DEFAULT_SIZES: Final = tuple(KiB << i for i in range(13))
#: Descriptor counts: 1 .. 4096, powers of 2.
DEFAULT_COUNTS: Final = tuple(1 << i for i in range(13))
#: The largest copy measured (count x size); the sim moves real bytes, so larger cells are left out.
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
#: The columns of the CSV form, in order (one row per direction, path, size, count).
CSV_COLUMNS: Final = ("schema_version", "profile", "provenance_kind", "direction", "path", "size_bytes", "count",
                      "time_s", "gbps", "fixed_s", "per_descriptor_s")

Direction = Literal["d2h", "h2d"]
#: The table's directions: a store (device to host) and a load (host to device).
DIRECTIONS: Final[tuple[Direction, ...]] = ("d2h", "h2d")


class CopyRig:
    """A sim under one profile forced onto one path, with a device array and a pinned host array of ``rows`` rows
    of ``size`` bytes: times single copies and a store + load pair.

    Args:
        profile: the profile.
        path: the path every copy takes (one of ``paths_of(profile)``).
        size: the descriptor size in bytes.
        rows: rows on each side (at least the largest count copied; 2x it for :meth:`duplex`).
    """

    def __init__(self, profile: CostProfile, path: PathName, size: int, rows: int) -> None:
        variant, copy_path = path_variant(profile, path)
        # Invariant: the sim every copy of this rig runs on, idle between two calls.
        self.be = SimBackend(profile=variant, copy_path=copy_path)
        # Invariant: every descriptor's size; row i of either side starts at i x size.
        self.size = size
        # Invariant: the device rows' base address (an array the sim owns for the rig's life).
        self._dev = self.be.array_info(self.be.empty_device((rows, size))).ptr
        # Invariant: the host rows, pinned (tracked and registered) for the rig's life; _hptr their base address.
        self._host = np.zeros(rows * size, np.uint8)
        self._hptr = int(self._host.ctypes.data)
        self.be.track_host(self._hptr, self._host.nbytes)
        self.be.host_register(self._hptr, self._host.nbytes)

    def _submit(self, direction: Direction, first: int, count: int) -> tuple[Any, Any]:
        """One copy of rows [first, first + count): device row i <-> host row (first + count - 1 - (i - first))."""
        be, size = self.be, self.size
        dev = self._dev + (first + np.arange(count, dtype=np.int64)) * size
        host = self._hptr + (first + np.arange(count - 1, -1, -1, dtype=np.int64)) * size
        src, dst = (dev, host) if direction == "d2h" else (host, dev)
        buf = be.alloc_descriptors(count)
        buf.fill(src, dst, np.full(count, size, np.int64))
        stream, start, end = be.create_stream(), be.create_event(), be.create_event()
        be.record(start, stream)
        be.copy_batch(stream, buf, count)
        be.record(end, stream)
        return start, end

    def _took(self, events: tuple[Any, Any]) -> float:
        self.be.synchronize(events[1])
        return float(self.be.elapsed(*events))

    def time(self, direction: Direction, count: int) -> float:
        """Seconds one copy of ``count`` descriptors takes alone, from its submission to its end.

        Args:
            direction: ``"d2h"`` (a store) or ``"h2d"`` (a load).
            count: descriptors (at most the rig's rows).

        Returns:
            The copy's duration on the virtual clock.
        """
        return self._took(self._submit(direction, 0, count))

    def duplex(self, count: int) -> tuple[float, float]:
        """A store of rows [0, count) and a load of rows [count, 2 count) submitted together on two streams.

        Args:
            count: descriptors in each (the rig needs 2 x count rows).

        Returns:
            ``(store seconds, load seconds)``, each from the pair's submission to that copy's end.
        """
        store, load = self._submit("d2h", 0, count), self._submit("h2d", count, count)
        return self._took(store), self._took(load)


@dataclasses.dataclass(frozen=True)
class _Grid:
    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    max_bytes: int

    def counts_for(self, size: int) -> tuple[int, ...]:
        return tuple(c for c in self.counts if c * size <= self.max_bytes)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _series(rig: CopyRig, direction: Direction, path: PathName, counts: tuple[int, ...]) -> list[dict[str, Any]]:
    """The rows of one (direction, path, size), each with the line through the first and the last count's times
    (None with one count)."""
    times = [rig.time(direction, c) for c in counts]
    fixed: float | None = None
    slope: float | None = None
    if len(counts) > 1:   # the line through the first and the last count
        slope = (times[-1] - times[0]) / (counts[-1] - counts[0])
        fixed = times[0] - slope * counts[0]
    return [{"direction": direction, "path": path, "size_bytes": rig.size, "count": c, "time_s": t,
             "gbps": _gbps(c * rig.size, t), "fixed_s": fixed, "per_descriptor_s": slope}
            for c, t in zip(counts, times, strict=True)]


def _duplex_row(rig: CopyRig, path: PathName, count: int) -> dict[str, Any]:
    """The pair run together against each alone. The alone times are taken again here, next to the pair, not
    reused from the series: a time is a difference of two clock readings, so figures read at the same clock
    magnitude compare exactly (reused ones put the speed-up over serial at 2 + 4e-16)."""
    store_alone, load_alone = rig.time("d2h", count), rig.time("h2d", count)
    store, load = rig.duplex(count)
    nbytes = count * rig.size
    return {"path": path, "size_bytes": rig.size, "count": count, "store_alone_s": store_alone,
            "load_alone_s": load_alone, "store_together_s": store, "load_together_s": load,
            "together_s": max(store, load), "together_gbps": _gbps(2 * nbytes, max(store, load)),
            "speedup_vs_serial": (store_alone + load_alone) / max(store, load)}


def _measure(profile: CostProfile, grid: _Grid) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in paths_of(profile):
        for size in grid.sizes:
            counts = grid.counts_for(size)
            if not counts:
                continue
            pair = max((c for c in counts if 2 * c * size <= grid.max_bytes), default=None)
            rig = CopyRig(profile, path, size, max(counts[-1], 2 * pair if pair else 0))
            for direction in DIRECTIONS:
                for row in _series(rig, direction, path, counts):
                    yield "rows", row
            if pair is not None:
                yield "duplex", _duplex_row(rig, path, pair)


def build(profile: str | CostProfile, *, sizes: Iterable[int] = DEFAULT_SIZES,
          counts: Iterable[int] = DEFAULT_COUNTS, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Measure the cost table of a profile on the sim (the module docstring; docs/cost-table.md).

    Args:
        profile: a profile name (``sim_profiles.PROFILES``) or a profile.
        sizes: descriptor sizes in bytes.
        counts: descriptor counts per copy.
        max_bytes: the largest copy measured (count x size); larger cells are left out.

    Returns:
        The table as JSON-ready data: ``schema_version``, ``profile``, ``provenance``, ``units``, ``shape``,
        ``grid``, ``rows`` (one per direction, path, size, count) and ``duplex`` (one per path and size).

    Raises:
        ValueError: an unknown profile, or a size, count or ``max_bytes`` that is not a positive int.
    """
    chosen = profile_named(profile)
    sizes, counts = list(sizes), list(counts)
    for value in (*sizes, *counts, max_bytes):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"sizes, counts and max_bytes must be positive ints; got {value!r}")
    grid = _Grid(tuple(sorted(set(sizes))), tuple(sorted(set(counts))), max_bytes)
    named = PROFILES.get(chosen.name) == chosen
    provenance = PROVENANCE[chosen.name] if named else None
    table: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "profile": chosen.name,
        "provenance": dataclasses.asdict(provenance) if provenance is not None else None,
        "units": {"time": "s", "size": "bytes", "bandwidth": "GB/s (1e9 bytes/s)"},
        "shape": "one copy_batch alone on an idle simulated device: count descriptors of size bytes, each its own "
                 "contiguous run, host side pinned, forced onto one path",
        "grid": {"sizes": list(grid.sizes), "counts": list(grid.counts), "max_bytes": grid.max_bytes},
        "rows": [], "duplex": []}
    for section, row in _measure(chosen, grid):
        table[section].append(row)
    return table


def to_json(table: dict[str, Any]) -> str:
    """The table as JSON text.

    Args:
        table: what :func:`build` returned.

    Returns:
        Indented JSON, ending with a newline.
    """
    return json.dumps(table, indent=1) + "\n"


def to_csv(table: dict[str, Any]) -> str:
    """The table's rows as CSV text (the duplex rows and the provenance's lists are in the JSON form only).

    Args:
        table: what :func:`build` returned.

    Returns:
        A header of :data:`CSV_COLUMNS`, then one line per row; floats as ``repr`` (exact), None as empty.
    """
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    kind = table["provenance"]["kind"] if table["provenance"] else ""
    for row in table["rows"]:
        writer.writerow({"schema_version": table["schema_version"], "profile": table["profile"],
                         "provenance_kind": kind, **{k: repr(v) if isinstance(v, float) else v
                                                     for k, v in row.items()}})
    return out.getvalue()
