#!/usr/bin/env python3
"""Bandwidth of CupyBackend.copy_batch against the copies it replaces, and the kernel/memcpy crossover.

Run from the repository root on a machine with a GPU (the package need not be installed):

    PYTHONPATH=. python3 scripts/gpu_bench.py [--quick] [--json results.json]

For 4 KiB, 64 KiB and 1 MiB pages it measures store (GPU -> pinned host) and load (pinned host -> GPU) of a
scattered transfer (GPU block i <-> host slot perm[i], a random permutation) through ``copy_batch`` (auto, forced
kernel, forced memcpy), against (1) one contiguous ``cudaMemcpyAsync`` of the same bytes between the same buffers
and (2) a Python loop of one ``cudaMemcpyAsync`` per block. Times are CUDA events around the submission (so the
Python cost of submitting counts), median of several repetitions after a warm-up. Every copy_batch path is checked
byte-exact once. Then it measures kernel vs memcpy for page sizes x descriptor counts, which is what the ``auto``
thresholds (kernel_min_count, kernel_max_mean_bytes) are chosen from, and prints a markdown report.

This file is not part of the package and is never imported by it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import mmap
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

KiB, MiB = 1024, 1024 * 1024
I64 = npt.NDArray[np.int64]


def import_backend() -> tuple[Any, str]:
    """The CuPy backend module; if the package's __init__ fails to import (work in progress elsewhere), load the
    backend modules without running it."""
    try:
        return importlib.import_module("kvoffload_ref.backends.cupy"), ""
    except Exception as exc:
        root = Path(__file__).resolve().parent.parent / "kvoffload_ref"
        for name in [m for m in sys.modules if m == "kvoffload_ref" or m.startswith("kvoffload_ref.")]:
            del sys.modules[name]
        for name, path in (("kvoffload_ref", root), ("kvoffload_ref.backends", root / "backends")):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
        note = f"(package __init__ failed: {type(exc).__name__}: {exc}; backend loaded without it)"
        return importlib.import_module("kvoffload_ref.backends.cupy"), note


class Bench:
    """Shared state: the backend, one timing stream and its two events."""

    def __init__(self, cb: Any, reps: int) -> None:
        self.cb = cb
        self.be = cb.CupyBackend(0)
        self.cp = importlib.import_module("cupy")
        self.rt = self.cp.cuda.runtime
        self.reps = reps
        self.stream = self.be.create_stream()
        self.start, self.end = self.be.create_event(), self.be.create_event()
        if not self.be.warm_up():
            print(f"WARNING: kernel path unavailable: {self.be.kernel_unavailable}")

    def time(self, op: Callable[[], None], reps: int | None = None) -> float:
        """Median seconds of ``op`` between two events on the stream, after one warm-up run."""
        samples: list[float] = []
        for i in range((reps or self.reps) + 1):
            self.be.record(self.start, self.stream)
            op()
            self.be.record(self.end, self.stream)
            self.be.synchronize(self.end)
            if i:
                samples.append(float(self.be.elapsed(self.start, self.end)))
        return statistics.median(samples)

    def contiguous(self, dst: int, src: int, nbytes: int) -> Callable[[], None]:
        ptr = self.stream.ptr
        return lambda: self.rt.memcpyAsync(dst, src, nbytes, 4, ptr)

    def loop(self, dst: I64, src: I64, page: int) -> Callable[[], None]:
        pairs = list(zip(dst.tolist(), src.tolist(), strict=True))
        memcpy, ptr = self.rt.memcpyAsync, self.stream.ptr

        def run() -> None:
            for d, s in pairs:
                memcpy(d, s, page, 4, ptr)
        return run

    def batch(self, buf: Any, count: int, path: str) -> Callable[[], None]:
        def run() -> None:
            self.be.copy_path = path
            self.be.copy_batch(self.stream, buf, count, tag=("store", 0))
        return run

    def close(self) -> None:
        self.be.copy_path = "auto"
        self.be.destroy_event(self.start)
        self.be.destroy_event(self.end)
        self.be.destroy_stream(self.stream)


@contextmanager
def pinned_region(bench: Bench, nbytes: int) -> Iterator[tuple[int, npt.NDArray[np.uint8], float]]:
    """An anonymous mmap registered through the backend (as the real region): (ptr, view, register seconds)."""
    mm = mmap.mmap(-1, nbytes)
    view = np.frombuffer(mm, np.uint8)
    view[::4096] = 0  # fault the pages in before registering
    ptr = int(view.ctypes.data)
    bench.be.track_host(ptr, nbytes)
    t0 = time.perf_counter()
    bench.be.host_register(ptr, nbytes)
    seconds = time.perf_counter() - t0
    try:
        yield ptr, view, seconds
    finally:
        bench.be.host_unregister(ptr)
        bench.be.untrack_host(ptr)
        del view
        with suppress(BufferError):  # a caller's view still alive: the mmap closes when it is collected
            mm.close()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def pattern(bench: Bench, rows: int, page: int) -> Any:
    """A device array whose bytes differ between rows (a cheap hash of the byte index)."""
    cp = bench.cp
    idx = cp.arange(rows * page, dtype=cp.uint32)
    data = ((idx * cp.uint32(2654435761)) >> cp.uint32(13)).astype(cp.uint8).reshape(rows, page)
    out = bench.be.empty_device((rows, page))
    out[...] = data
    bench.cp.cuda.get_current_stream().synchronize()
    return out


def verify(bench: Bench, buf: Any, count: int, path: str, clear: Callable[[], None],
           check: Callable[[], bool]) -> str:
    clear()
    bench.cp.cuda.get_current_stream().synchronize()
    bench.batch(buf, count, path)()
    took = str(bench.be.last_copy_path)
    bench.be.record(bench.end, bench.stream)
    bench.be.synchronize(bench.end)
    ok = check()
    return f"{path}->{took}:{'ok' if ok else 'MISMATCH'}"


def run_config(bench: Bench, page: int, count: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The main comparison for one page size; returns one result row per direction."""
    nbytes = page * count
    be = bench.be
    dev = pattern(bench, count, page)
    dev2 = be.empty_device((count, page))
    g, g2 = be.array_info(dev), be.array_info(dev2)
    perm = rng.permutation(count).astype(np.int64)
    ids = np.arange(count, dtype=np.int64)
    sizes = np.full(count, page, np.int64)
    rows: list[dict[str, Any]] = []
    with pinned_region(bench, nbytes) as (hptr, hview, reg_s):
        host = hview.reshape(count, page)
        store, load = be.alloc_descriptors(count), be.alloc_descriptors(count)
        store.fill(g.ptr + ids * page, hptr + perm * page, sizes)
        load.fill(hptr + perm * page, g2.ptr + ids * page, sizes)
        expect = be.to_host(dev)
        checks = []
        for path in ("kernel", "memcpy"):
            checks.append(verify(bench, store, count, path, lambda: host.fill(0),
                                 lambda: bool(np.array_equal(host[perm], expect))))
            checks.append(verify(bench, load, count, path, lambda: dev2.fill(0),
                                 lambda: bool(np.array_equal(be.to_host(dev2), expect))))
        for direction, buf, c_dst, c_src, l_dst, l_src in (
            ("store", store, hptr, g.ptr, hptr + perm * page, g.ptr + ids * page),
            ("load", load, g2.ptr, hptr, g2.ptr + ids * page, hptr + perm * page),
        ):
            t = {
                "contiguous": bench.time(bench.contiguous(c_dst, c_src, nbytes)),
                "loop": bench.time(bench.loop(l_dst, l_src, page)),
                "auto": bench.time(bench.batch(buf, count, "auto")),
                "kernel": bench.time(bench.batch(buf, count, "kernel")),
                "memcpy": bench.time(bench.batch(buf, count, "memcpy")),
            }
            be.copy_path = "auto"
            auto_path = be.choose_path(buf.src[:count], buf.dst[:count], buf.sizes[:count])
            rows.append({"page": page, "count": count, "direction": direction, "bytes": nbytes,
                         "register_gbps": gbps(nbytes, reg_s), "auto_path": auto_path,
                         "gbps": {k: gbps(nbytes, v) for k, v in t.items()}, "seconds": t, "checks": checks})
        be.free_descriptors(store)
        be.free_descriptors(load)
    return rows


def crossover(bench: Bench, rng: np.random.Generator, pages: list[int], counts: list[int],
              region_bytes: int) -> list[dict[str, Any]]:
    """Kernel vs memcpy time for page sizes x descriptor counts, both directions."""
    be = bench.be
    dev = be.empty_device((region_bytes // MiB, MiB))
    g = be.array_info(dev)
    out: list[dict[str, Any]] = []
    with pinned_region(bench, region_bytes) as (hptr, _view, _s):
        for page in pages:
            slots = region_bytes // page
            for count in [c for c in counts if c <= slots]:
                dev_ids = rng.choice(slots, count, replace=False).astype(np.int64)
                host_ids = rng.choice(slots, count, replace=False).astype(np.int64)
                sizes = np.full(count, page, np.int64)
                buf = be.alloc_descriptors(count)
                for direction in ("store", "load"):
                    dev_addr, host_addr = g.ptr + dev_ids * page, hptr + host_ids * page
                    if direction == "store":
                        buf.fill(dev_addr, host_addr, sizes)
                    else:
                        buf.fill(host_addr, dev_addr, sizes)
                    tk = bench.time(bench.batch(buf, count, "kernel"))
                    tm = bench.time(bench.batch(buf, count, "memcpy"))
                    out.append({"page": page, "count": count, "direction": direction,
                                "kernel_us": tk * 1e6, "memcpy_us": tm * 1e6})
                be.free_descriptors(buf)
    be.copy_path = "auto"
    return out


def recommend(cross: list[dict[str, Any]]) -> dict[str, int]:
    """Thresholds from the crossover: the kernel must win (or tie within 5%) in both directions."""
    wins: dict[tuple[int, int], bool] = {}
    for r in cross:
        key = (r["page"], r["count"])
        wins[key] = wins.get(key, True) and r["kernel_us"] <= 1.05 * r["memcpy_us"]
    pages = sorted({p for p, _ in wins})
    min_counts: list[int] = []
    max_page = 0
    for page in pages:
        counts = sorted(c for p, c in wins if p == page)
        # smallest count from which the kernel wins at every larger count
        first = next((c for i, c in enumerate(counts) if all(wins[(page, d)] for d in counts[i:])), None)
        if first is not None and first <= 64:
            max_page = page
            min_counts.append(first)
    return {"kernel_min_count": max(min_counts) if min_counts else 1 << 30, "kernel_max_mean_bytes": max_page}


def environment(bench: Bench) -> list[str]:
    rt, cp = bench.rt, bench.cp
    driver = rt.driverGetVersion()
    runtime = rt.runtimeGetVersion()
    attr91 = rt.deviceGetAttribute(91, 0)
    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- GPU: {bench.be.device_name} ({bench.be.sm_count} SMs)",
        f"- CuPy {cp.__version__}, CUDA driver {driver // 1000}.{driver % 1000 // 10}, "
        f"runtime {runtime // 1000}.{runtime % 1000 // 10}, numpy {np.__version__}, Python {platform.python_version()}",
        f"- cudaDevAttrCanUseHostPointerForRegisteredMem (91) = {attr91}",
        f"- backend thresholds now: kernel_min_count={bench.be.kernel_min_count}, "
        f"kernel_max_mean_bytes={bench.be.kernel_max_mean_bytes}",
    ]


def print_main(rows: list[dict[str, Any]]) -> None:
    print("| page | dir | pages | contiguous GB/s | loop GB/s | batch auto GB/s (path) | kernel GB/s | "
          "memcpy GB/s | auto/contig | auto/loop | register GB/s | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["gbps"]
        print(f"| {r['page'] // KiB} KiB | {r['direction']} | {r['count']} | {b['contiguous']:.1f} | "
              f"{b['loop']:.2f} | {b['auto']:.1f} ({r['auto_path']}) | {b['kernel']:.1f} | {b['memcpy']:.2f} | "
              f"{b['auto'] / b['contiguous']:.2f} | {b['auto'] / b['loop']:.1f} | {r['register_gbps']:.1f} | "
              f"{' '.join(r['checks'])} |")


def print_goals(rows: list[dict[str, Any]]) -> None:
    print("\n## Goals\n")
    for r in rows:
        b = r["gbps"]
        ratio = b["auto"] / b["contiguous"]
        want = {64 * KiB: 0.9, 4 * KiB: 0.7}.get(r["page"])
        parts = []
        if want is not None:
            parts.append(f">= {want} of contiguous: {'MET' if ratio >= want else 'NOT MET'} ({ratio:.2f})")
        parts.append(f"not slower than the loop: {'MET' if b['auto'] >= b['loop'] else 'NOT MET'}")
        print(f"- {r['page'] // KiB} KiB {r['direction']}: " + "; ".join(parts))


def print_crossover(cross: list[dict[str, Any]]) -> None:
    print("\n## Kernel vs memcpy crossover (copy_batch, microseconds, median)\n")
    print("| page | count | store kernel | store memcpy | load kernel | load memcpy |")
    print("|---|---|---|---|---|---|")
    by_key: dict[tuple[int, int], dict[str, float]] = {}
    for r in cross:
        cell = by_key.setdefault((r["page"], r["count"]), {})
        cell[f"{r['direction']}_kernel"] = r["kernel_us"]
        cell[f"{r['direction']}_memcpy"] = r["memcpy_us"]
    for (page, count), c in sorted(by_key.items()):
        print(f"| {page // KiB} KiB | {count} | {c['store_kernel']:.1f} | {c['store_memcpy']:.1f} | "
              f"{c['load_kernel']:.1f} | {c['load_memcpy']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers and fewer repetitions")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    cb, note = import_backend()
    usable, reason = cb.gpu_usable()
    if not usable:
        print(f"no usable GPU: {reason}")
        return 2
    reps = 3 if args.quick else 5
    total = 32 * MiB if args.quick else 256 * MiB
    bench = Bench(cb, reps)
    rng = np.random.default_rng(0)
    print("# kvoffload_ref CuPy backend benchmark\n")
    print("\n".join(environment(bench)) + (f"\n- note: {note}" if note else ""))
    counts = {4 * KiB: total // 4 // (4 * KiB), 64 * KiB: total // (64 * KiB), MiB: total // MiB}
    print(f"- transfer: scattered (random permutation); pages per transfer: "
          f"{', '.join(f'{p // KiB} KiB x {c}' for p, c in counts.items())}; median of {reps} after 1 warm-up\n")
    results: dict[str, Any] = {"environment": environment(bench)}
    failures: list[str] = []
    try:
        rows = []
        for page, count in counts.items():
            try:
                rows += run_config(bench, page, count, rng)
            except Exception:  # report and go on: one broken configuration must not hide the others
                failures.append(f"{page // KiB} KiB: {traceback.format_exc()}")
        print_main(rows)
        print_goals(rows)
        results["main"] = rows
        failures += [f"{r['page'] // KiB} KiB {r['direction']}: {c}" for r in rows for c in r["checks"]
                     if not c.endswith(":ok")]
        try:
            cross = crossover(bench, rng, [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB],
                              [1, 4, 16, 64, 256, 1024] if not args.quick else [1, 16, 256],
                              64 * MiB if args.quick else 256 * MiB)
            print_crossover(cross)
            rec = recommend(cross)
            results["crossover"], results["recommended"] = cross, rec
            print(f"\nRecommended auto thresholds (kernel wins or ties within 5% in both directions): "
                  f"kernel_min_count={rec['kernel_min_count']}, kernel_max_mean_bytes={rec['kernel_max_mean_bytes']}")
        except Exception:
            failures.append(f"crossover: {traceback.format_exc()}")
    finally:
        bench.close()
        results["failures"] = failures
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
    live = bench.be.ledger.live()
    print(f"\nledger after the benchmark: live={live or 'nothing'}")
    for failure in failures:
        print(f"\nFAILURE {failure}")
    return 1 if failures or live else 0


if __name__ == "__main__":
    sys.exit(main())
