"""The timeline format both devices write: Chrome trace-event JSON (opens in Perfetto and ``chrome://tracing``).

Pure (the standard library only). The simulated device (``_simtrace``) writes it from its virtual clock, the CuPy
backend (``_cupy_trace``) from CUDA events, so a prediction and a measurement of one schedule open side by side.

The document is ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``; every event has ``ph``,
``ts`` (microseconds), ``pid`` and ``tid``:

* ``"M"`` ``thread_name``: one track per stream (``tid`` 0 is the device itself: markers that belong to no stream);
* ``"X"`` spans with ``dur``: a copy (``"store job 3"``; args ``bytes``, ``descriptors``, ``path``, ``gbps``), a
  compute work, a record (``dur`` 0), a wait;
* ``"s"``/``"f"`` flow pairs (same ``id``): a ``wait_event`` edge from the record to the wait it released;
* ``"i"`` instants: a fault fired, a violation (a ``dma_race`` marks both operations' tracks).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["HOST_TRACK", "PID", "TraceBuilder", "check_trace", "copy_args", "copy_name", "load_trace", "merge",
           "write_document", "write_merged"]

#: The track of what the host did (its polls and the sleeps between them), apart from every device stream's.
HOST_TRACK: Final = "host (polling)"
#: The process id of every event (one device per file).
PID: Final = 1


def copy_name(tag: tuple[str, int] | None) -> str:
    """A copy span's name: the transfer its tag names (``"store job 3"``), else ``"copy"``."""
    return "copy" if tag is None else f"{tag[0]} job {tag[1]}"


def copy_args(nbytes: int, descriptors: int, path: str, seconds: float) -> dict[str, object]:
    """A copy span's args: bytes, descriptors, path and the GB/s its duration implies."""
    return {"bytes": nbytes, "descriptors": descriptors, "path": path,
            "gbps": round(nbytes / seconds / 1e9, 4) if seconds > 0 else None}


class TraceBuilder:
    """Collects trace events; :meth:`document` returns the JSON-ready dict.

    Args:
        source: what produced the timeline (``"sim profile h200"``, ``"cupy NVIDIA H200"``), kept in
            ``otherData``.
    """

    def __init__(self, source: str) -> None:
        # Invariant: set once; the document's otherData.source.
        self.source = source
        # Invariant: the events in the order added; thread names first for every track used.
        self.events: list[dict[str, Any]] = []
        # Invariant: track name -> tid (1, 2, ... in first-use order; 0 is the device track).
        self._tids: dict[str, int] = {}
        # Invariant: the next flow id; each s/f pair takes a fresh one.
        self._flow_ids = itertools.count(1)
        self.track("device")

    def track(self, name: str) -> int:
        """The tid of a track by name (created, with its ``thread_name``, on first use)."""
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids)
            self.events.append({"ph": "M", "name": "thread_name", "ts": 0, "pid": PID, "tid": tid,
                                "args": {"name": name}})
        return tid

    def span(self, tid: int, name: str, start_s: float, end_s: float, cat: str,
             args: Mapping[str, object] | None = None) -> None:
        """A complete (``"X"``) event from ``start_s`` to ``end_s`` seconds."""
        self.events.append({"ph": "X", "name": name, "cat": cat, "ts": start_s * 1e6,
                            "dur": max(0.0, end_s - start_s) * 1e6, "pid": PID, "tid": tid,
                            "args": dict(args or {})})

    def instant(self, tid: int, name: str, at_s: float, cat: str, args: Mapping[str, object] | None = None) -> None:
        """An instant (``"i"``, thread scope) marker."""
        self.events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "ts": at_s * 1e6, "pid": PID,
                            "tid": tid, "args": dict(args or {})})

    def flow(self, from_tid: int, from_s: float, to_tid: int, to_s: float, name: str = "wait_event") -> None:
        """A flow arrow (an ``"s"`` and an ``"f"`` event sharing a fresh id)."""
        fid = next(self._flow_ids)
        self.events.append({"ph": "s", "id": fid, "name": name, "cat": "flow", "ts": from_s * 1e6, "pid": PID,
                            "tid": from_tid})
        self.events.append({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": "flow", "ts": to_s * 1e6,
                            "pid": PID, "tid": to_tid})

    def document(self, **other: object) -> dict[str, Any]:
        """The trace document (``other`` goes into ``otherData`` beside ``source``)."""
        return {"traceEvents": list(self.events), "displayTimeUnit": "ms",
                "otherData": {"source": self.source, **other}}


def merge(parts: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Several trace documents in one: part ``i`` becomes process ``i + 1``, named by its label (so a sim
    prediction and a GPU measurement of one schedule, or a demo's acts, open side by side). Flow ids are
    renumbered so they stay unique.

    Args:
        parts: ``(label, document)`` pairs.

    Returns:
        The merged document (``otherData.parts``: each part's label and ``otherData``).
    """
    events: list[dict[str, Any]] = []
    flow_base = 0
    for pid, (label, doc) in enumerate(parts, 1):
        events.append({"ph": "M", "name": "process_name", "ts": 0, "pid": pid, "tid": 0, "args": {"name": label}})
        top = 0
        for event in doc.get("traceEvents", []):
            copy = {**event, "pid": pid}
            if "id" in copy and copy.get("ph") in ("s", "f"):
                top = max(top, int(copy["id"]))
                copy["id"] = int(copy["id"]) + flow_base
            events.append(copy)
        flow_base += top
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"parts": [{"label": label, **dict(doc.get("otherData", {}))} for label, doc in parts]}}


def write_document(path: str, doc: Mapping[str, Any]) -> None:
    """Write a trace document to ``path`` as JSON, one line (open it in Perfetto or ``chrome://tracing``).

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")


def write_merged(path: str, parts: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Write :func:`merge` of ``parts`` to ``path`` as JSON.

    Raises:
        OSError: the file cannot be written.
    """
    write_document(path, merge(parts))


def load_trace(path: str) -> dict[str, Any]:
    """Read a trace document (a dict with ``traceEvents``, or a bare event list).

    Raises:
        OSError: the file cannot be read.
        ValueError: not JSON, or not a trace.
    """
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"path {str(path)!r}: not a Chrome trace: expected a JSON list of events or an object with "
                         f"a traceEvents list (e.g. {{\"traceEvents\": []}}), got {type(doc).__name__}")
    return doc


def check_trace(doc: Mapping[str, Any]) -> list[str]:
    """Schema problems of a trace document (empty: none): every event has ph, ts, pid, tid; spans have a dur
    >= 0; every flow id has exactly one ``s`` and one ``f``, the ``f`` not before the ``s``.

    Returns:
        One line per problem.
    """
    problems: list[str] = []
    flows: dict[object, list[dict[str, Any]]] = {}
    for i, e in enumerate(doc.get("traceEvents", [])):
        missing = [k for k in ("ph", "ts", "pid", "tid") if k not in e]
        if missing:
            problems.append(f"event {i} lacks {missing}: {e}")
            continue
        if e["ph"] == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            problems.append(f"span {i} has no dur >= 0: {e}")
        if e["ph"] in ("s", "f"):
            flows.setdefault(e.get("id"), []).append(e)
    for fid, pair in flows.items():
        kinds = sorted(e["ph"] for e in pair)
        if kinds != ["f", "s"]:
            problems.append(f"flow {fid} has {kinds}, expected one s and one f")
        elif next(e for e in pair if e["ph"] == "f")["ts"] < next(e for e in pair if e["ph"] == "s")["ts"]:
            problems.append(f"flow {fid} ends before it starts")
    return problems
