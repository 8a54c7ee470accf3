#!/usr/bin/env python3
"""Three schedules on the GPU (CuPy backend, CUDA-event timeline) and on the sim with ``profile="h200"``: both
traces' totals and their ratio (goal: within +-15 %; a miss means the profile needs a refit, see docs/simulator.md).

    PYTHONPATH=. python3 scripts/sim_vs_gpu.py [--out DIR]

Schedules: (1) a scattered store, 64 KiB x 2048 pages, one ``copy_batch`` (auto path); (2) a concurrent store and
load, 64 KiB x 1024 pages each, on two streams submitted back to back; (3) the layer-wise prefetch example
(docs/examples/layerwise_prefetch.py; its GPU compute is a framework kernel, not the sim's 60 us, so its total is
the least comparable). A total is the span of the trace's copies (first start to last end). With ``--out`` each
schedule's sim and GPU traces go into ``DIR/<schedule>.json`` as one file (two processes: open it in Perfetto).
Exit 0 when every ratio is within the goal, 1 when one misses, 2 without a usable GPU (the sim side is printed).
Not part of the package; never imported by it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import mmap
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.trace_format import merge

ROOT = Path(__file__).resolve().parent.parent
PAGE = 64 * 1024
GOAL = 0.15


def _host(be: Any, nbytes: int) -> tuple[int, Callable[[], None]]:
    """Pinned host memory tracked by the backend (an anonymous mmap); returns its pointer and a release."""
    mm = mmap.mmap(-1, nbytes)
    view: Any = np.frombuffer(mm, np.uint8)
    view[::4096] = 0
    ptr = int(view.ctypes.data)
    be.track_host(ptr, nbytes)
    be.host_register(ptr, nbytes)

    def release() -> None:  # holds the mmap (and its view) until the memory is given back
        nonlocal view
        be.host_unregister(ptr)
        be.untrack_host(ptr)
        view = None
        with contextlib.suppress(BufferError):  # a view still alive elsewhere: the mmap closes when collected
            mm.close()
    return ptr, release


def _copies(be: Any, jobs: list[tuple[str, int]], seed: int = 0) -> None:
    """Submit one scattered copy per (direction, pages) job, each on its own stream, back to back; wait."""
    rng = np.random.default_rng(seed)
    total = sum(n for _, n in jobs)
    dev = be.empty_device((total, PAGE))
    g = be.array_info(dev)
    hptr, release = _host(be, total * PAGE)
    live: list[tuple[Any, Any, Any]] = []
    first = 0
    for number, (direction, n) in enumerate(jobs):
        rows = first + np.arange(n, dtype=np.int64)
        slots = first + rng.permutation(n).astype(np.int64)
        first += n
        d, h = g.ptr + rows * g.row_stride, hptr + slots * PAGE
        buf = be.alloc_descriptors(n)
        buf.fill(*((d, h) if direction == "store" else (h, d)), np.full(n, PAGE, np.int64))
        stream, end = be.create_stream(), be.create_event()
        live.append((buf, stream, end))
        be.copy_batch(stream, buf, n, tag=(direction, number))
        be.record(end, stream)
    for buf, stream, end in live:
        be.synchronize(end)
        be.destroy_event(end)
        be.destroy_stream(stream)
        be.free_descriptors(buf)
    release()


def _layerwise(gpu: bool, path: str) -> None:
    spec = importlib.util.spec_from_file_location("_layerwise", ROOT / "docs" / "examples" / "layerwise_prefetch.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    if gpu:  # pragma: no cover - needs a GPU
        example.gpu_step(order=True, trace=path)
    else:
        be, tensors = example.sim_device(profile="h200", trace=True)
        example.run_step(be, tensors)
        be.write_trace(path)


def total_seconds(doc: dict[str, Any]) -> float:
    """First copy start to last copy end, in seconds."""
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "copy"]
    if not spans:
        return float("nan")
    return (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6


SCHEDULES: dict[str, list[tuple[str, int]] | None] = {
    "scattered store": [("store", 2048)],
    "concurrent store+load": [("store", 1024), ("load", 1024)],
    "layer-wise example": None,
}


def run(schedule: str, gpu: bool) -> dict[str, Any]:
    """One schedule's trace document on the GPU (``gpu``) or on the sim (profile h200)."""
    jobs = SCHEDULES[schedule]
    if jobs is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "t.json")
            _layerwise(gpu, path)
            return dict(json.loads(Path(path).read_text()))
    if gpu:  # pragma: no cover - needs a GPU
        from kvoffload_ref.backends.cupy import CupyBackend  # noqa: PLC0415

        be: Any = CupyBackend()
        be.start_trace()
        _copies(be, jobs)
        doc = be.trace_document()
        be.stop_trace()
        return dict(doc)
    sim = SimBackend(profile="h200", trace=True)
    _copies(sim, jobs)
    return sim.trace_document()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write each schedule's traces here")
    args = parser.parse_args(argv)
    try:
        from kvoffload_ref.backends.cupy import gpu_usable  # noqa: PLC0415

        usable, reason = gpu_usable()
    except ImportError as exc:
        usable, reason = False, str(exc)
    print("| schedule | sim h200 total (ms) | GPU total (ms) | sim / GPU | within +-15 % |")
    print("|---|---|---|---|---|")
    missed = 0
    for schedule in SCHEDULES:
        sim = run(schedule, gpu=False)
        real = run(schedule, gpu=True) if usable else None
        t_sim = total_seconds(sim)
        if real is None:
            print(f"| {schedule} | {t_sim * 1e3:.3f} | n/a | n/a | n/a |")
            continue
        t_gpu = total_seconds(real)
        ratio = t_sim / t_gpu
        ok = abs(ratio - 1) <= GOAL
        missed += not ok
        print(f"| {schedule} | {t_sim * 1e3:.3f} | {t_gpu * 1e3:.3f} | {ratio:.3f} | {'yes' if ok else '**no**'} |")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            name = schedule.replace(" ", "_").replace("+", "_")
            (args.out / f"{name}.json").write_text(json.dumps(merge([("sim h200", sim), ("GPU", real)])))
    if not usable:
        print(f"\nno usable GPU ({reason}): only the sim's side; the calibration rests on docs/gpu-check.json")
        return 2
    print("\nA ratio outside +-15 %: refit the h200 profile (kvoffload_ref/backends/sim_profiles.py) "
          "to the new figures.")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
