"""The failure-mode table (docs/failure-modes.md): each fault, what vLLM does, and what kvoffload_ref does.

The two vLLM columns are facts from the upstream code (see the project's reference notes). The two kvoffload_ref
columns are *measured*: each scenario below runs a worker on the simulated device with the fault injected, once per
policy, and the cell is produced from the shutdown report, the ledger and the sim's violation log.
``kvoffload-ref failure-modes --check`` regenerates the table and compares it with the committed file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import pathlib
from collections.abc import Callable, Iterator

import numpy as np

from kvoffload_ref.backends.base import Event
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import DeviceError
from kvoffload_ref.faults import Fault, FaultPlan
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import CPUOffloadingWorker, ShutdownPolicy, ShutdownReport, create_worker

__all__ = ["GUARANTEES", "ROWS", "Guarantee", "check", "guarantee_table", "quiet", "render", "run_scenario",
           "vllm_cells", "write_readme_table"]

TIMEOUT = 1.0
_LAYOUT = KVCacheLayout(tensor_page_bytes=(512, 512), groups=((LayerRef(0, 512), LayerRef(1, 512)),))


@dataclasses.dataclass(frozen=True)
class Row:
    """One fault: its name, the two vLLM behaviours, and how to set it up."""

    fault: str
    vllm_before: str
    vllm_after: str
    faults: tuple[Fault, ...] = ()
    setup: str = "busy"  # which scenario driver runs it


ROWS: tuple[Row, ...] = (
    Row("transfer end event fails during the shutdown drain (store job 1)",
        "the error escapes the store handler's shutdown: the load handler is never shut down, the region leaks",
        "logged; both handlers shut down; best-effort device sync; region released",
        (Fault("event_query", "error", direction="store", job_id=1),)),
    Row("event query error in `get_finished` (store job 1)",
        "the error escapes `get_finished`; a transfer that completes is always reported `success=True`",
        "same as before",
        (Fault("event_query", "error", direction="store", job_id=1),), "poll"),
    Row("event never completes (load job 3)",
        "`shutdown()` blocks forever in `synchronize()`", "`shutdown()` blocks forever in `synchronize()`",
        (Fault("copy", "hang", direction="load", job_id=3),)),
    Row("device sync error (after a failed transfer)",
        "no device sync exists", "warning logged; region released anyway (may still be under DMA)",
        (Fault("event_query", "error", direction="store", job_id=1), Fault("device_sync", "error"))),
    Row("device sync hang (after a failed transfer)",
        "no device sync exists", "`torch.accelerator.synchronize()` blocks forever",
        (Fault("event_query", "error", direction="load", job_id=3), Fault("device_sync", "hang"))),
    Row("host register failure at chunk 2",
        "one registration call; warning, region stays pageable",
        "chunks rolled back in reverse; warning, region stays pageable",
        (Fault("host_register", "error", nth=2),), "construct"),
    Row("host unregister failure",
        "warning `cudaHostUnregister failed`; cleanup goes on", "same as before",
        (Fault("host_unregister", "error"),)),
    Row("mmap close `BufferError` (a view still exported)",
        "logged `Failed to close mmap_obj`", "same as before", (), "view"),
    Row("stream/event creation failure at submit",
        "router catches it, logs, returns `False`", "`AssertionError`/`RuntimeError` reaches the caller",
        (Fault("event_create", "error", job_id=2, nth=1),), "submit"),
    Row("construction failure (event creation)",
        "region and its `/dev/shm` file leak", "#51227: `create_worker` cleans the region; no test covers it",
        (Fault("event_create", "error", nth=2),), "construct"),
    Row("`KeyboardInterrupt` during shutdown",
        "propagates at once; nothing cleared", "propagates at once; nothing cleared",
        (Fault("copy", "hang", direction="store", job_id=1),), "interrupt"),
    Row("process exit without `shutdown()`",
        "`atexit` cleanup of the file only; no drain", "`atexit` cleanup of the file only; no drain",
        (), "drop"),
)


def _busy(be: SimBackend, policy: str) -> CPUOffloadingWorker:
    gpu = [be.empty_device((64, 512)) for _ in range(2)]
    w = create_worker(be, gpu, _LAYOUT, blocks_per_chunk=1, num_cpu_chunks=64,  # 4 registrations per tensor (R29)
                      policy=ShutdownPolicy(TIMEOUT, policy), pin_chunk_bytes=8192)
    for job, direction in ((1, "store"), (2, "store"), (3, "load"), (4, "load")):
        gspec = GPULoadStoreSpec([job], group_sizes=(1,), block_indices=(0,))
        cspec = CPULoadStoreSpec([job])
        if direction == "store":
            w.submit_store(job, gspec, cspec)
        else:
            w.submit_load(job, cspec, gspec)
    return w


def _summary(be: SimBackend, report: ShutdownReport) -> str:
    parts = [f"shutdown {report.elapsed:.2f} s", f"store {report.store.drained} ok/{report.store.abandoned} "
             f"abandoned", f"load {report.load.drained} ok/{report.load.abandoned} abandoned",
             f"proof {report.device_sync}", f"region **{report.region}**"]
    if report.quarantined:
        parts.append("quarantined " + ", ".join(f"{k} {v}" for k, v in sorted(report.quarantined.items())))
    if report.kept:  # R29: only the registrations an unproven copy may touch
        parts.append(f"kept {sum(k.length for k in report.kept) >> 10} KiB in {len(report.kept)} range(s)")
    if report.leaked:
        parts.append("leaked " + ", ".join(f"{k} {v}" for k, v in sorted(report.leaked.items())))
    if report.interrupted:
        parts.append("re-raised")
    parts.append(f"{len(be.violations)} use-after-free")
    return "; ".join(parts)


def _run_busy(row: Row, policy: str) -> str:
    be = SimBackend(FaultPlan(row.faults))
    return _summary(be, _busy(be, policy).shutdown())


def _run_poll(row: Row, policy: str) -> str:
    be = SimBackend(FaultPlan(row.faults))
    w = _busy(be, policy)
    be.clock_advance(1.0)
    results = w.get_finished()
    failed = sorted(r.job_id for r in results if not r.success)
    ok = sorted(r.job_id for r in results if r.success)
    return f"jobs {ok} `success=True`, {failed} `success=False` with the error; " + _summary(be, w.shutdown())


def _run_construct(row: Row, policy: str) -> str:
    be = SimBackend(FaultPlan(row.faults))
    gpu = [be.empty_device((64, 512)) for _ in range(2)]
    try:
        w = create_worker(be, gpu, _LAYOUT, blocks_per_chunk=1, num_cpu_chunks=64,
                          policy=ShutdownPolicy(TIMEOUT, policy), pin_chunk_bytes=8192)
    except DeviceError as exc:
        return f"`DeviceError({exc.status})` re-raised; ledger live after: {be.ledger.live() or 'nothing'}"
    state = "pinned" if w.stats().pinned else ("pageable (warning; the CuPy backend refuses this fallback: a copy "
                                               "to pageable memory would block the host, R11), registered chunks "
                                               "rolled back")
    report = w.shutdown()
    return f"worker runs {state}; " + _summary(be, report)


def _run_view(row: Row, policy: str) -> str:
    be = SimBackend()
    w = _busy(be, policy)
    view = np.frombuffer(w._core.region._mmap, np.uint8)  # type: ignore[arg-type]  # a caller keeps a view
    report = w.shutdown()
    del view
    return "`Failed to close mmap_obj` logged, mapping kept (no dangling view); " + _summary(be, report)


def _run_submit(row: Row, policy: str) -> str:
    be = SimBackend(FaultPlan(row.faults))
    gpu = [be.empty_device((64, 512)) for _ in range(2)]
    w = create_worker(be, gpu, _LAYOUT, blocks_per_chunk=1, num_cpu_chunks=16,
                      policy=ShutdownPolicy(TIMEOUT, policy))
    spec = GPULoadStoreSpec([1], group_sizes=(1,), block_indices=(0,))
    w.submit_store(1, spec, CPULoadStoreSpec([1]))
    try:
        w.submit_store(2, spec, CPULoadStoreSpec([2]))
        outcome = "accepted"
    except DeviceError as exc:
        outcome = f"`DeviceError({exc.status})` raised, nothing queued"
    return f"{outcome}; " + _summary(be, w.shutdown())


class _InterruptOnQuery(SimBackend):
    def __init__(self, plan: FaultPlan) -> None:
        super().__init__(plan)
        self.armed = False

    def query(self, event: Event) -> bool:
        if self.armed:
            raise KeyboardInterrupt
        return super().query(event)


def _run_interrupt(row: Row, policy: str) -> str:
    be = _InterruptOnQuery(FaultPlan(row.faults))
    w = _busy(be, policy)
    be.armed = True
    with contextlib.suppress(KeyboardInterrupt):
        w.shutdown()
    be.armed = False
    return _summary(be, w.shutdown())


def _run_drop(row: Row, policy: str) -> str:
    be = SimBackend()
    w = _busy(be, policy)
    del w
    gc.collect()
    return f"finalizer shut it down; ledger live after: {be.ledger.live() or 'nothing'}; " \
           f"{len(be.violations)} use-after-free"


_DRIVERS: dict[str, Callable[[Row, str], str]] = {
    "busy": _run_busy, "poll": _run_poll, "construct": _run_construct, "view": _run_view,
    "submit": _run_submit, "interrupt": _run_interrupt, "drop": _run_drop,
}



@dataclasses.dataclass(frozen=True)
class Guarantee:
    """One row of README's guarantee table: a topic, what kvoffload_ref guarantees, and vLLM's behaviour --
    taken from the failure-mode row ``fault`` names (one source of truth), or stated here when no fault row covers
    the topic."""

    topic: str
    ours: str
    fault: str | None = None
    vllm_before: str = ""
    vllm_after: str = ""


GUARANTEES: tuple[Guarantee, ...] = (
    Guarantee("Region owner", "worker (R1), caller until construction succeeds (R2)",
              vllm_before="store handler", vllm_after="worker"),
    Guarantee("One handler raises during shutdown", "logged, kept in the report, the other handler still shut "
              "down (R9)", fault="transfer end event fails during the shutdown drain (store job 1)"),
    Guarantee("Hung transfer at shutdown", "bounded by one timeout (R11); the region is quarantined until exit "
              '(R12) under the default policy, released under "release"', fault="event never completes (load job 3)"),
    Guarantee("Memory possibly under DMA after a failed transfer", "quarantined until exit (R12), unless policy "
              '"release"', fault="device sync error (after a failed transfer)"),
    Guarantee("Failed transfer", "`success=False` with the error, and the ones behind it (R5)",
              fault="event query error in `get_finished` (store job 1)"),
    Guarantee("Bad input", "`InvalidTransferError`, nothing changed (R7)",
              vllm_before="`AssertionError`", vllm_after="`AssertionError`"),
    Guarantee("Ctrl-C during shutdown", "abandons, quarantines, releases the rest, re-raises (R14)",
              fault="`KeyboardInterrupt` during shutdown"),
    Guarantee("Process exit without `shutdown()`", "the finalizer shuts it down under the same rules (R15)",
              fault="process exit without `shutdown()`"),
    Guarantee("Resource accounting", "ledger: nothing live after shutdown but the listed quarantine (R16)",
              vllm_before="—", vllm_after="—"),
)

_README_BEGIN = "<!-- guarantees: generated from kvoffload_ref/docgen/failure_modes.py -->"
_README_END = "<!-- /guarantees -->"


def vllm_cells(guarantee: Guarantee) -> tuple[str, str]:
    """vLLM's behaviour before and after #51622 for one guarantee row ("same as before" spelled out).

    Args:
        guarantee: the row.

    Returns:
        (before, after).

    Raises:
        KeyError: ``guarantee.fault`` names no failure-mode row.
    """
    if guarantee.fault is None:
        return guarantee.vllm_before, guarantee.vllm_after
    row = {r.fault: r for r in ROWS}[guarantee.fault]
    return row.vllm_before, row.vllm_before if row.vllm_after == "same as before" else row.vllm_after


def guarantee_table() -> str:
    """README's guarantee table (markdown, between its generated-block markers)."""
    lines = [_README_BEGIN, "| | vLLM before #51622 | vLLM after #51622 | kvoffload_ref |", "|---|---|---|---|"]
    for g in GUARANTEES:
        before, after = vllm_cells(g)
        lines.append(f"| {g.topic} | {before} | {after} | {g.ours} |")
    return "\n".join([*lines, _README_END]) + "\n"


def write_readme_table(root: pathlib.Path) -> bool:
    """Replace README.md's generated guarantee table under ``root``; returns whether it was found."""
    path = root / "README.md"
    text = path.read_text()
    begin, end = text.find(_README_BEGIN), text.find(_README_END)
    if begin < 0 or end < begin:
        return False
    path.write_text(text[:begin] + guarantee_table() + text[end + len(_README_END) + 1:])
    return True

@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The library's logs off while the generated docs' scenarios run (their errors are expected)."""
    log = logging.getLogger("kvoffload_ref")
    previous = log.level
    log.setLevel(logging.CRITICAL + 1)  # child loggers inherit it: the scenarios' expected errors stay quiet
    try:
        yield
    finally:
        log.setLevel(previous)


def run_scenario(row: Row, policy: str) -> str:
    """Run one row under one policy ("quarantine" or "release") on the sim and describe the outcome."""
    with quiet():
        return _DRIVERS[row.setup](row, policy)


def render() -> str:
    """The whole markdown document, every kvoffload_ref cell freshly measured."""
    lines = [
        "# Failure modes: vLLM vs kvoffload_ref",
        "",
        "Each fault is injected on the simulated device into a worker with two stores and two loads in flight",
        f"(shutdown timeout {TIMEOUT:.0f} s, virtual clock). The vLLM columns describe upstream behaviour (before and",
        "after PR #51622); the kvoffload_ref columns are produced by running the scenario",
        "(`kvoffload_ref/docgen/failure_modes.py`; regenerate with `kvoffload-ref failure-modes --write`, CI checks",
        "it).",
        "\"use-after-free\" counts the sim's violations: copies touching memory released under them.",
        "The worker's region is 64 KiB in 8 registrations; a quarantine keeps only those an unproven copy may",
        "still touch (\"kept\", R29) and gives back the rest.",
        "",
        "| fault | vLLM before #51622 | vLLM after #51622 | kvoffload_ref (quarantine policy) | "
        "kvoffload_ref (release policy) |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        cells = [row.fault, row.vllm_before, row.vllm_after,
                 run_scenario(row, "quarantine"), run_scenario(row, "release")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check(root: pathlib.Path) -> bool:
    """Whether docs/failure-modes.md under ``root`` equals a fresh run."""
    path = root / "docs" / "failure-modes.md"
    return path.exists() and path.read_text() == render()
