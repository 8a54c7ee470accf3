"""Feed ``kvoffload-ref cost-table`` JSON to a toy tier model: how long offloading (a store, GPU -> CPU) and
onloading (a load, CPU -> GPU) one request's KV takes on each platform, on its cheapest copy path.

Run::

    kvoffload-ref cost-table --profile h20 --output h20.json
    kvoffload-ref cost-table --profile mi300x --output mi300x.json
    kvoffload-ref cost-table --profile mi355x --output mi355x.json
    python docs/examples/cost_table_tier.py h20.json mi300x.json mi355x.json

A request is ``count`` descriptors of ``size`` bytes copied in one batch (vLLM's CPU offload: a block's KV per
layer group is one descriptor). Only the JSON is read: no kvoffload_ref import, as in a serving simulator.
"""

from __future__ import annotations

import json
import sys
from typing import Any

#: (name, descriptor bytes, descriptors), 4 descriptors a block: a 16-block request (64 x 16 KiB), and a long one
#: past the table's grid (its counts stop at 4,096).
REQUESTS = (("16 blocks", 16 * 1024, 64), ("2,048 blocks", 16 * 1024, 8192))


def copy_time(table: dict[str, Any], direction: str, path: str, size: int, count: int) -> float:
    """Seconds one copy takes: the table's row, or past the grid its series' line (fixed + count x per
    descriptor, the cost of one copy alone on an idle device)."""
    rows = [r for r in table["rows"] if (r["direction"], r["path"], r["size_bytes"]) == (direction, path, size)]
    for row in rows:
        if row["count"] == count:
            return float(row["time_s"])
    return float(rows[-1]["fixed_s"] + count * rows[-1]["per_descriptor_s"])


def report(table: dict[str, Any]) -> list[str]:
    """One line per request and direction: the time on each path, the cheapest, its GB/s; then, on the path
    cheapest for the last load, a store and a load together against one after the other."""
    paths = sorted({r["path"] for r in table["rows"]})
    lines = [f"{table['profile']} ({table['provenance']['kind']})"]
    best = paths[0]
    for name, size, count in REQUESTS:
        for direction, what in (("d2h", "offload"), ("h2d", "onload ")):
            times = {p: copy_time(table, direction, p, size, count) for p in paths}
            best = min(times, key=lambda p: times[p])
            each = ", ".join(f"{p} {t * 1e6:,.0f} us" for p, t in times.items())
            lines.append(f"  {name} ({count} x {size // 1024} KiB) {what}: {each} -> {best}, "
                         f"{count * size / times[best] / 1e9:.1f} GB/s")
    (duplex,) = [r for r in table["duplex"] if (r["path"], r["size_bytes"]) == (best, 16 * 1024)]
    lines.append(f"  a store and a load together ({duplex['count']} x 16 KiB each, {best}): "
                 f"{duplex['speedup_vs_serial']:.2f}x faster than one after the other")
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            print("\n".join(report(json.load(f))))


if __name__ == "__main__":
    main(sys.argv[1:])
