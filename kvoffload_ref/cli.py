"""The ``kvoffload-ref`` command line: ``demo``, ``bench``, ``fuzz``, ``diagram``, ``spec``, ``failure-modes``.

``demo`` runs the main job on the simulated device: a realistic layout, a few hundred store and load jobs with
every byte verified, then a never-completing load to show a bounded shutdown that quarantines the region, and the
same fault under the vLLM #51622 "release" policy to show the use-after-free it allows. Exit status 0 only if
every check held.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvoffload_ref import diagram as diagram_mod
from kvoffload_ref import failure_modes
from kvoffload_ref import spec as spec_mod
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.bench import run_bench
from kvoffload_ref.faults import Fault, FaultPlan
from kvoffload_ref.layout import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import CPUOffloadingWorker, ShutdownPolicy, ShutdownReport, create_worker

__all__ = ["main"]

PAGE = 16 * 1024
NUM_LAYERS = 8
BPC = 4
GPU_BLOCKS = 512
JOBS = 128  # stores, and as many loads
CPU_CHUNKS = JOBS * 2 * 8 // BPC
BLOCKS_PER_JOB = 8  # per group


class _Checks:
    """Counts checks and prints the failed ones."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"  CHECK FAILED: {what}")


def _layout() -> KVCacheLayout:
    half = NUM_LAYERS // 2
    return KVCacheLayout(
        tensor_page_bytes=(PAGE,) * NUM_LAYERS,
        groups=(tuple(LayerRef(t, PAGE) for t in range(half)),
                tuple(LayerRef(t, PAGE) for t in range(half, NUM_LAYERS))),
    )


def _gpu_spec(blocks: npt.NDArray[np.int64]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(np.concatenate([blocks, blocks]), group_sizes=(len(blocks), len(blocks)),
                            block_indices=(0, 0))


def _round_trip(checks: _Checks) -> None:
    """Store JOBS jobs, load every one back (in waves) into other GPU blocks, verify every byte."""
    rng = np.random.default_rng(42)
    be = SimBackend()
    source = [rng.integers(0, 256, (GPU_BLOCKS, PAGE), dtype=np.uint8) for _ in range(NUM_LAYERS)]
    gpu = [be.from_host(a) for a in source]
    chunks_per_job = BLOCKS_PER_JOB // BPC
    with create_worker(be, gpu, _layout(), blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS) as w:
        stored = []
        for job in range(JOBS):
            blocks = rng.choice(GPU_BLOCKS // 2, BLOCKS_PER_JOB, replace=False).astype(np.int64)
            chunks = np.arange(2 * chunks_per_job, dtype=np.int64) + job * 2 * chunks_per_job
            w.submit_store(job, _gpu_spec(blocks), CPULoadStoreSpec(chunks))
            stored.append((blocks, chunks))
        w.wait(range(JOBS))
        results = w.get_finished()
        checks.check(len(results) == JOBS and all(r.success for r in results), "every store succeeded")
        wave = GPU_BLOCKS // 2 // BLOCKS_PER_JOB  # loads per wave: each wave fills the upper half of the GPU
        exact = True
        for first in range(0, JOBS, wave):
            jobs = range(first, min(first + wave, JOBS))
            for i, job in enumerate(jobs):
                dst = GPU_BLOCKS // 2 + i * BLOCKS_PER_JOB + np.arange(BLOCKS_PER_JOB, dtype=np.int64)
                w.submit_load(JOBS + job, CPULoadStoreSpec(stored[job][1]), _gpu_spec(dst))
            w.wait(JOBS + j for j in jobs)
            after = [be.to_host(a) for a in gpu]
            exact &= all(np.array_equal(after[t][GPU_BLOCKS // 2 + i * BLOCKS_PER_JOB:][:BLOCKS_PER_JOB],
                                        source[t][stored[job][0]])
                         for i, job in enumerate(jobs) for t in range(NUM_LAYERS))
        loads = w.get_finished()
        checks.check(len(loads) == JOBS and all(r.success for r in loads), "every load succeeded")
        checks.check(exact, "every loaded byte equals the stored byte")
        results += loads
        nbytes = sum(r.transfer_size or 0 for r in results)
        seconds = sum(r.transfer_time or 0.0 for r in results)
        print(f"round trip: {len(results)} jobs ({JOBS} stores, {len(loads)} loads), {nbytes / 2**20:.0f} MiB "
              f"verified, sim device time {seconds * 1e3:.2f} ms, sim bandwidth "
              f"{nbytes / max(seconds, 1e-12) / 1e9:.1f} GB/s")
    report = w.shutdown()
    checks.check(report.region == "released" and report.device_sync == "not_needed", "clean shutdown released")
    checks.check(not be.ledger.live(), f"ledger balanced after shutdown (live: {be.ledger.live()})")
    checks.check(not be.violations, f"no use-after-free (violations: {be.violations})")


def _hung_shutdown(checks: _Checks, on_unproven: str) -> None:
    """A load that never completes; shutdown must return within its timeout."""
    be = SimBackend(FaultPlan([Fault("copy", "hang", direction="load", job_id=2)]))
    layout = _layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(NUM_LAYERS)]
    policy = ShutdownPolicy(timeout=2.0, on_unproven=on_unproven)
    w: CPUOffloadingWorker = create_worker(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                                           policy=policy)
    blocks = np.arange(BLOCKS_PER_JOB, dtype=np.int64)
    chunks = np.arange(BLOCKS_PER_JOB // BPC * 2, dtype=np.int64)
    w.submit_store(1, _gpu_spec(blocks), CPULoadStoreSpec(chunks))
    w.submit_load(2, CPULoadStoreSpec(chunks), _gpu_spec(blocks + 100))
    w.submit_load(3, CPULoadStoreSpec(chunks), _gpu_spec(blocks + 200))
    report = w.shutdown()
    _print_report(f"hung load, policy {on_unproven!r}", report)
    checks.check(report.elapsed <= policy.timeout + 0.01, f"shutdown bounded ({report.elapsed:.3f} s)")
    checks.check(report.load.abandoned == 2, "the hung load and the one behind it were abandoned")
    checks.check(report.device_sync == "timeout", "the device-level proof timed out")
    if on_unproven == "quarantine":
        checks.check(report.region == "quarantined", "region quarantined, not freed under DMA")
        checks.check(not be.violations, "no use-after-free under the quarantine policy")
        checks.check(not be.ledger.live(), "nothing live but the quarantine")
    else:
        checks.check(report.region == "released", "region released anyway (vLLM #51622 behaviour)")
        kinds = sorted({v.kind for v in be.violations})
        print(f"  use-after-free detected by the sim under 'release': {kinds}")
        checks.check(bool(be.violations), "the sim detects the release under DMA")


def _print_report(title: str, report: ShutdownReport) -> None:
    print(f"{title}: shutdown in {report.elapsed:.3f} s (sim clock), device_sync={report.device_sync}, "
          f"region={report.region}")
    print(f"  store drained={report.store.drained} abandoned={report.store.abandoned}; "
          f"load drained={report.load.drained} abandoned={report.load.abandoned}")
    print(f"  quarantined={dict(report.quarantined)} leaked={dict(report.leaked)} errors={len(report.errors)}")


class _NoTraceback(logging.Formatter):
    def formatException(self, ei: object) -> str:
        return ""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_text = ""
        text = super().format(record)
        return text if not record.exc_info else f"{text} ({record.exc_info[1]!r})"


def demo() -> int:
    """Run the demo; returns the exit status."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_NoTraceback("  [log %(levelname)s] %(message)s"))
    logging.getLogger("kvoffload_ref").addHandler(handler)
    checks = _Checks()
    _round_trip(checks)
    _hung_shutdown(checks, "quarantine")
    _hung_shutdown(checks, "release")
    print(f"{checks.passed} checks passed, {len(checks.failed)} failed")
    return 0 if not checks.failed else 1


def _spec(check_only: bool, root: str) -> int:
    path = pathlib.Path(root)
    if not check_only:
        spec_mod.write(path)
    problems = spec_mod.check(path)
    for problem in problems:
        print(f"spec: {problem}")
    if not problems:
        print("spec: every rule is cited by a test and the generated docs are current")
    return 1 if problems else 0


def _failure_modes(check_only: bool, write: bool, root: str) -> int:
    path = pathlib.Path(root)
    if check_only:
        ok = failure_modes.check(path)
        print("failure-modes: docs/failure-modes.md is current" if ok else
              "failure-modes: docs/failure-modes.md is out of date (run: kvoffload-ref failure-modes --write)")
        return 0 if ok else 1
    text = failure_modes.render()
    if write:
        (path / "docs" / "failure-modes.md").write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvoffload-ref``."""
    parser = argparse.ArgumentParser(
        prog="kvoffload-ref", description="kvoffload_ref: a reference KV-cache offloading worker (GPU <-> pinned CPU)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="round trips, a hung shutdown and the release-policy hazard, on the sim")
    sub.add_parser("diagram", help="print the lifecycle machines as Mermaid stateDiagram-v2 text")
    spec = sub.add_parser("spec", help="check (or --write) docs/spec.md's rule->test lists and docs/lifecycle.md")
    mode = spec.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only check (the default)")
    mode.add_argument("--write", action="store_true", help="regenerate, then check")
    spec.add_argument("--root", default=".", help="repository root (default: the current directory)")
    modes = sub.add_parser("failure-modes", help="regenerate (--write) or --check docs/failure-modes.md")
    fm_mode = modes.add_mutually_exclusive_group()
    fm_mode.add_argument("--check", action="store_true", help="compare with the committed table")
    fm_mode.add_argument("--write", action="store_true", help="rewrite docs/failure-modes.md")
    modes.add_argument("--root", default=".", help="repository root (default: the current directory)")
    bench = sub.add_parser("bench", help="measure the planner, the sim data path, shutdown and fuzzing (ratios)")
    bench.add_argument("--json", default=None, help="also write the results as JSON to this path")
    bench.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    fuzz = sub.add_parser("fuzz", help="a stateful fuzz campaign of the worker against the lifecycle model")
    fuzz.add_argument("--steps", type=int, default=10_000, help="rule steps to run (default 10000)")
    fuzz.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    fuzz.add_argument("--policy", choices=("quarantine", "release"), default=None,
                      help="shutdown policy to fuzz (default: drawn per run)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        run_bench(args.json, quick=args.quick)
        return 0
    if args.command == "fuzz":
        # Imported here: the conformance kit needs Hypothesis, which the demo and the core do not.
        from kvoffload_ref.testing.campaign import run_campaign  # noqa: PLC0415

        return int(run_campaign(args.steps, args.seed, args.policy))
    if args.command == "failure-modes":
        return _failure_modes(args.check, args.write, args.root)
    if args.command == "demo":
        return demo()
    if args.command == "spec":
        return _spec(not args.write, args.root)
    sys.stdout.write(diagram_mod.render())
    return 0
