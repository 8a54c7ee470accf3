"""``kvoffload-ref trace-plot TRACE.json OUT.png``: draw a timeline (``backends.trace_format``) with matplotlib.

One panel per act (``demo --trace`` names each device "act N: ..."; else one per device), each with its own time
axis; in it one row per track (process, stream), a stream named by what ran on it ("store stream (s1)"); a bar per
span, coloured by what it is (a store, a load, by copy path; compute work; a wait); thin arrows for ``wait_event``
edges; a red cross for a violation, an orange triangle for a fault. The host's polling (the sleeps between its
queries) is drawn apart, hatched, under a dashed line: a gap on a stream there is the host waiting, not the device.
matplotlib is optional (``pip install "kvoffload_ref[plot]"``); it is imported only when a picture is drawn.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from collections.abc import Mapping
from typing import Any, Final

from kvoffload_ref.backends.trace_format import HOST_TRACK, load_trace

__all__ = ["HINT", "Panel", "main", "panels", "plot"]

#: The one line printed when matplotlib is missing.
HINT: Final = ('kvoffload-ref trace-plot needs matplotlib: pip install "kvoffload_ref[plot]" '
               "(or: pip install matplotlib)")

_COLOURS: Final = {"store": "#1f77b4", "load": "#2ca02c", "copy": "#7f7f7f", "compute": "#ff7f0e",
                   "sync": "#c7c7c7", "stuck": "#d62728"}
_PATH_SHADE: Final = {"kernel": 1.0, "memcpy": 0.6, "dma": 0.8, "simple": 0.9}
_HOST: Final = "#8c564b"  # the host's polling: hatched, on its own lane
#: A transfer's direction in a span or marker name ("store job 1", "fault: hang after load job 2").
_DIRECTION: Final = re.compile(r"\b(store|load) job\b")


def _colour(event: Mapping[str, Any]) -> tuple[str, float]:
    cat = str(event.get("cat", ""))
    if cat == "copy":
        name = str(event.get("name", ""))
        kind = "store" if name.startswith("store") else "load" if name.startswith("load") else "copy"
        return _COLOURS[kind], _PATH_SHADE.get(str(event.get("args", {}).get("path", "")), 0.9)
    return _COLOURS.get(cat, "#9467bd"), 0.9


@dataclasses.dataclass(frozen=True)
class Panel:
    """One act (or one device) of a trace: its own rows and its own time axis."""

    title: str
    # Invariant: (pid, tid) -> row index, device lanes first, then the host's polling lanes.
    rows: dict[tuple[int, int], int]
    labels: list[str]
    # Invariant: the rows at and after this index are the host's (drawn apart, under a dashed line).
    host_from: int
    scale: float
    unit: str


def panels(doc: Mapping[str, Any]) -> list[Panel]:
    """The panels a trace is drawn as: one per act -- the processes whose names share the text before the first
    ": " (``demo --trace`` names each device ``"act N: ..."``) -- or one per process; each with its own time axis.
    A stream's lane is named by the transfers it ran or held (copies, copies that never ran, stalls): "store
    stream (s1)", "load stream (s5)"; "compute" keeps its name; the host's polling lane is listed last.

    Args:
        doc: a trace document (``backends.trace_format``).

    Returns:
        The panels, in the trace's order.
    """
    events = list(doc.get("traceEvents", []))
    names = {(e["pid"], e["tid"]): str(e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    procs = {e["pid"]: str(e["args"]["name"]) for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    seen = {(e.get("pid"), e.get("tid")) for e in events if e.get("ph") in ("X", "i")}
    copies: dict[tuple[int, int], set[str]] = {}  # the directions of the transfers each track ran or held
    for e in events:
        if e.get("cat") in ("copy", "stuck", "fault"):
            found = _DIRECTION.search(str(e.get("name", "")))
            if found is not None:
                copies.setdefault((e["pid"], e["tid"]), set()).add(found.group(1))
    groups: dict[str, list[int]] = {}
    for pid in sorted({k[0] for k in names}):
        groups.setdefault(procs.get(pid, "").split(": ", 1)[0], []).append(pid)
    result, source = [], str(doc.get("otherData", {}).get("source") or "timeline")
    for act, pids in groups.items():
        keys = [k for k in names if k[0] in pids and k in seen]
        host = [k for k in keys if names[k] == HOST_TRACK]
        ordered = [k for k in keys if k not in host] + host
        prefix = {pid: procs[pid].split(": ", 1)[1] + ": " if len(pids) > 1 and ": " in procs.get(pid, "") else ""
                  for pid in pids}
        labels = [prefix[k[0]] + _lane(names[k], copies.get(k, set())) for k in ordered]
        scale, unit = _unit([e for e in events if e.get("pid") in pids and e.get("ph") in ("X", "i", "s", "f")])
        title = (procs.get(pids[0], act) if len(pids) == 1 else act) or source
        result.append(Panel(title, {k: i for i, k in enumerate(ordered)}, labels,
                            len(ordered) - len(host), scale, unit))
    return result


def _lane(name: str, directions: set[str]) -> str:
    """A track's label: a stream named by the copies it ran, the host's polling lane, or its own name."""
    if name == HOST_TRACK:
        return "host: polling (not the device)"
    if directions in ({"store"}, {"load"}):
        return f"{next(iter(directions))} stream ({name})"
    return f"copy stream ({name})" if directions else name


def plot(doc: Mapping[str, Any], out: str, title: str | None = None) -> int:
    """Draw ``doc`` into the PNG ``out``: one panel per act (:func:`panels`), each with its own time axis.

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
    drawn_panels = panels(doc)
    heights = [max(len(p.labels), 1) + 1.2 for p in drawn_panels]
    fig, axes = plt.subplots(len(drawn_panels), 1, figsize=(13, 0.42 * sum(heights) + 1.0), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    drawn = 0
    for panel, ax in zip(drawn_panels, axes[:, 0], strict=True):
        drawn += _draw_panel(ax, panel, events)
    source = doc.get("otherData", {}).get("source")
    fig.suptitle(title or (f"timeline: {source}" if source else "timeline"))
    legend = {k: c for k, c in _COLOURS.items() if any(_colour(e)[0] == c for e in events if e.get("ph") == "X")}
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in legend.items()]
    if any(e.get("cat") == "host" for e in events):
        handles.append(matplotlib.patches.Patch(facecolor="white", edgecolor=_HOST, hatch="///",
                                                label="host polling"))
    if handles:
        fig.legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def _draw_panel(ax: Any, panel: Panel, events: list[dict[str, Any]]) -> int:
    """One act's rows on its own time axis; the host's polling under a dashed line, hatched."""
    rows, scale, drawn = panel.rows, panel.scale, 0
    bars: dict[tuple[int, str, float, bool], list[tuple[float, float]]] = {}
    host: list[tuple[float, float, int]] = []
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if key not in rows:
            continue
        if e.get("ph") == "X" and e.get("cat") == "host":
            host.append((float(e["ts"]) * scale, float(e["dur"]) * scale, rows[key]))
        elif e.get("ph") == "X":
            colour, alpha = _colour(e)
            bars.setdefault((rows[key], colour, alpha, e.get("cat") == "copy"), []).append(
                (float(e["ts"]) * scale, max(float(e["dur"]), 0.0) * scale))
            drawn += 1
        elif e.get("ph") == "i" and e.get("cat") == "host":
            ax.plot(float(e["ts"]) * scale, rows[key], "|", color=_HOST, markersize=8, zorder=4)
        elif e.get("ph") == "i":
            violation = e.get("cat") == "violation"
            ax.plot(float(e["ts"]) * scale, rows[key], "x" if violation else "^",
                    color="#d62728" if violation else "#ff9900", markersize=10, markeredgewidth=2, zorder=4)
    for (row, colour, alpha, outlined), spans in bars.items():   # one artist per row and colour: fast
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=colour, alpha=alpha,
                       edgecolor="black" if outlined else "none", linewidth=0.3)
    for start, width, row in host:
        ax.broken_barh([(start, width)], (row - 0.3, 0.6), facecolors="white", edgecolor=_HOST, hatch="///",
                       linewidth=0.5)
    if panel.host_from < len(panel.labels):
        ax.axhline(panel.host_from - 0.5, color="#555555", linestyle="--", linewidth=0.8)
    _flows(ax, events, rows, scale)
    ax.set_yticks(range(len(panel.labels)), panel.labels, fontsize=8)
    ax.set_ylim(len(panel.labels) - 0.4, -0.6)
    ax.set_xlabel(f"time ({panel.unit})", fontsize=8)
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.grid(axis="x", linewidth=0.3)
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
