"""The bench's presentation: the markdown table, the machine description and JSON-safe values."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
from typing import cast

import numpy as np

__all__ = ["finite", "machine", "render"]



def _fmt(value: float | None, unit: str) -> str:
    """A value with its unit, human-scaled."""
    if value is None:
        return "n/a"
    if unit == "descriptors/s":
        return f"{value / 1e6:.3g} M desc/s"
    if unit == "bytes/s":
        return f"{value / 1e9:.2f} GB/s"
    if unit == "s":
        return f"{value * 1e3:.3g} ms"
    if unit == "virtual s":
        return f"{value:.4f} s (virtual)"
    return f"{value:,.0f} {unit}"


def _fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.3f}x"


def render(doc: dict[str, object]) -> str:
    """The markdown report of a :func:`run_bench` result: the table, the notes and the drain profile."""
    results = cast(list[dict[str, object]], doc["results"])
    lines = ["| metric | measured | reference (same run) | ratio | goal | met |",
             "|---|---|---|---|---|---|"]
    for r in results:
        met = {True: "yes", False: "**no**", None: "n/a"}[cast(bool | None, r["met"])]
        reference = f"{_fmt(cast(float | None, r['reference']), str(r['reference_unit']))} " \
                    f"({r['reference_label']})"
        lines.append(f"| {r['metric']} | {_fmt(cast(float | None, r['value']), str(r['unit']))} | {reference} | "
                     f"{_fmt_ratio(cast(float | None, r['ratio']))} | {r['goal']} | {met} |")
    lines += ["", "Notes:", ""]
    lines += [f"- {r['metric']}: {r['note']}" for r in results if r["note"]]
    profile = cast(list[dict[str, object]], doc["drain_profile"])
    lines += ["", "Top cost centers of one drain shutdown under cProfile (own time; profiling inflates it):", "",
              "| function | calls | own ms | cumulative ms |", "|---|---|---|---|"]
    lines += [f"| `{p['function']}` | {p['calls']} | {cast(float, p['tottime_ms']):.1f} | "
              f"{cast(float, p['cumtime_ms']):.1f} |" for p in profile]
    lines += ["", f"run_bench took {cast(float, doc['elapsed_s']):.1f} s ({'quick' if doc['quick'] else 'full'})."]
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what platform reports."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> dict[str, object]:
    """Python, numpy, platform, CPU count and the date (UTC)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "python": platform.python_version(), "implementation": platform.python_implementation(),
        "numpy": np.__version__, "platform": platform.platform(), "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(), "usable_cpus": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def finite(value: object) -> object:
    """``value`` with non-finite floats (nested too) turned into None, so the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


