"""``kvoffload-ref trace-plot TRACE.json OUT.png``: draw a timeline (``backends.trace_format``) with matplotlib.

One row per track (process, stream), top to bottom in the trace's order; a bar per span, coloured by what it is
(a store, a load, by copy path; compute work; a wait); thin arrows for ``wait_event`` edges; a red cross for a
violation, an orange triangle for a fault. matplotlib is optional (``pip install "kvoffload_ref[plot]"``); it is
imported only when a picture is drawn.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any, Final

from kvoffload_ref.backends.trace_format import load_trace

__all__ = ["HINT", "main", "plot"]

#: The one line printed when matplotlib is missing.
HINT: Final = ('kvoffload-ref trace-plot needs matplotlib: pip install "kvoffload_ref[plot]" '
               "(or: pip install matplotlib)")

_COLOURS: Final = {"store": "#1f77b4", "load": "#2ca02c", "copy": "#7f7f7f", "compute": "#ff7f0e",
                   "sync": "#c7c7c7", "stuck": "#d62728"}
_PATH_SHADE: Final = {"kernel": 1.0, "memcpy": 0.6, "dma": 0.8, "simple": 0.9}


def _colour(event: Mapping[str, Any]) -> tuple[str, float]:
    cat = str(event.get("cat", ""))
    if cat == "copy":
        name = str(event.get("name", ""))
        kind = "store" if name.startswith("store") else "load" if name.startswith("load") else "copy"
        return _COLOURS[kind], _PATH_SHADE.get(str(event.get("args", {}).get("path", "")), 0.9)
    return _COLOURS.get(cat, "#9467bd"), 0.9


def plot(doc: Mapping[str, Any], out: str, title: str | None = None) -> int:
    """Draw ``doc`` into the PNG ``out``.

    Args:
        doc: a trace document.
        out: the PNG path.
        title: the title (default: the trace's source).

    Returns:
        How many spans were drawn.

    Raises:
        ImportError: matplotlib is not installed.
    """
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    events = list(doc.get("traceEvents", []))
    names: dict[tuple[int, int], str] = {}
    procs: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = str(e["args"]["name"])
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = str(e["args"]["name"])
    seen = {(e.get("pid"), e.get("tid")) for e in events if e.get("ph") in ("X", "i")}
    used = [k for k in names if k in seen]
    rows = {k: i for i, k in enumerate(used)}
    scale, unit = _unit([e for e in events if e.get("ph") in ("X", "i", "s", "f")])
    fig, ax = plt.subplots(figsize=(12, 0.55 * max(len(rows), 2) + 1.6))
    drawn = 0
    bars: dict[tuple[int, str, float, bool], list[tuple[float, float]]] = {}
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "X" and key in rows:
            colour, alpha = _colour(e)
            width = max(float(e["dur"]), 0.0) * scale
            bars.setdefault((rows[key], colour, alpha, e.get("cat") == "copy"), []).append(
                (float(e["ts"]) * scale, width))
            drawn += 1
        elif e.get("ph") == "i" and key in rows:
            violation = e.get("cat") == "violation"
            ax.plot(float(e["ts"]) * scale, rows[key], "x" if violation else "^",
                    color="#d62728" if violation else "#ff9900", markersize=10, markeredgewidth=2, zorder=4)
    for (row, colour, alpha, outlined), spans in bars.items():   # one artist per row and colour: fast
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=colour, alpha=alpha,
                       edgecolor="black" if outlined else "none", linewidth=0.3)
    _flows(ax, events, rows, scale)
    labels = [f"{procs[k[0]]}: {names[k]}" if k[0] in procs else names[k] for k in used]
    ax.set_yticks(range(len(used)), labels)
    ax.set_ylim(len(used) - 0.4, -0.6)
    ax.set_xlabel(f"time ({unit})")
    source = doc.get("otherData", {}).get("source")
    ax.set_title(title or (f"timeline: {source}" if source else "timeline"))
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in _COLOURS.items()
               if any(_colour(e)[0] == c for e in events if e.get("ph") == "X")]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def _flows(ax: Any, events: list[dict[str, Any]], rows: dict[tuple[int, int], int], scale: float) -> None:
    """wait_event edges: a line from the record to the wait it released, a dot at the wait."""
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    segments, heads = [], []
    for e in events:
        s = starts.get(e.get("id")) if e.get("ph") == "f" else None
        if s is not None and (s["pid"], s["tid"]) in rows and (e["pid"], e["tid"]) in rows:
            head = (float(e["ts"]) * scale, rows[(e["pid"], e["tid"])])
            segments.append([(float(s["ts"]) * scale, rows[(s["pid"], s["tid"])]), head])
            heads.append(head)
    if segments:
        collections = importlib.import_module("matplotlib.collections")
        ax.add_collection(collections.LineCollection(segments, colors="#555555", linewidths=0.6, zorder=3))
        ax.plot([h[0] for h in heads], [h[1] for h in heads], ".", color="#555555", markersize=3, zorder=3)


def _unit(events: list[dict[str, Any]]) -> tuple[float, str]:
    """A scale from microseconds to a readable unit for the trace's span."""
    end = max((float(e["ts"]) + float(e.get("dur", 0.0)) for e in events), default=0.0)
    if end >= 2e6:
        return 1e-6, "s"
    if end >= 2e3:
        return 1e-3, "ms"
    return 1.0, "us"


def main(trace: str, out: str, title: str | None = None) -> int:
    """The command: 0 written; 2 matplotlib missing (one line: :data:`HINT`) or an unreadable trace.

    Args:
        trace: the trace JSON.
        out: the PNG.
        title: the picture's title.

    Returns:
        The exit status.
    """
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print(HINT, file=sys.stderr)
        return 2
    try:
        doc = load_trace(trace)
    except (OSError, ValueError) as exc:
        print(f"kvoffload-ref trace-plot: cannot read {trace}: {exc}", file=sys.stderr)
        return 2
    drawn = plot(doc, out, title)
    print(f"{out}: {drawn} spans drawn")
    return 0
