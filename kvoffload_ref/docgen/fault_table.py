"""The fault table of docs/simulator.md: for every fault point x kind, under which worker calls it can fire and what
the caller sees there -- the submission refused, a failed result, a raised error, a step of the shutdown report.

Nothing in the table is written by hand: each cell is *measured* on the simulated device, on both workers (the
engine and the reference; they must agree, or :func:`measure` raises). One scripted run (create, a store polled by
``get_finished``, a load awaited by ``wait``, ``shutdown``) is made once per (point, kind, call): the fault is armed
(:meth:`~kvoffload_ref.faults.FaultPlan.add`, every matching call from then on) just before that call, and the cell
says what that call did. A call under which the point is never consulted gets no cell. ``python -m
kvoffload_ref.docgen.fault_table --write`` regenerates the block in docs/simulator.md;
``tests/test_fault_table.py`` checks it is current.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable

from kvoffload_ref.backends.base import CONSULTED
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.docgen.failure_modes import quiet
from kvoffload_ref.errors import DeadlineExceeded, DeviceError
from kvoffload_ref.facade import WorkerFacade
from kvoffload_ref.fault_plan import HANG_POINTS, POINTS, TRANSFER_HANG_POINTS, Fault, FaultKind, FaultPlan
from kvoffload_ref.reference import create_reference_worker
from kvoffload_ref.results import ShutdownPolicy
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import create_worker

__all__ = ["CALLS", "BEGIN", "END", "Cell", "check", "measure", "render", "write"]

#: The worker calls of the scripted run, in order (``get_finished`` polls the store; ``wait`` awaits the load).
CALLS: tuple[str, ...] = ("create_worker", "submit_store", "get_finished", "submit_load", "wait", "shutdown")
BEGIN = "<!-- fault-table: generated from kvoffload_ref/docgen/fault_table.py -->"
END = "<!-- /fault-table -->"

_LAYOUT = KVCacheLayout(tensor_page_bytes=(512, 512), groups=((LayerRef(0, 512), LayerRef(1, 512)),))
_WORKERS: dict[str, Callable[..., WorkerFacade]] = {"engine": create_worker, "reference": create_reference_worker}


@dataclasses.dataclass(frozen=True)
class Cell:
    """What one call did with the fault armed just before it."""

    point: str
    kind: str
    call: str
    outcome: str
    worker: str


def _kinds(point: str) -> tuple[FaultKind, ...]:
    if point in TRANSFER_HANG_POINTS:
        return ("error", "hang", "slow")
    return ("error", "hang") if point in HANG_POINTS else ("error",)


def _fault(point: str, kind: FaultKind) -> Fault:
    return Fault(point, kind, duration=0.5 if kind == "slow" else None)  # type: ignore[arg-type]  # a POINTS name


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DeviceError):
        return ("refused: `DeviceError` (\"... was refused: nothing was queued ...\")" if "was refused" in str(exc)
                else f"raises `{type(exc).__name__}`")
    return f"raises `{type(exc).__name__}`"


def _results(results: list[object]) -> str:
    """A polled call's results, e.g. "job 1 failed" or "job 1 succeeded"."""
    return ", ".join(f"job {getattr(r, 'job_id', '?')} {'succeeded' if getattr(r, 'success', False) else 'failed'}"
                     for r in results)


def _gspec(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=(3,), block_indices=(0,))


def _step(call: str, worker: WorkerFacade) -> str:
    """Run one call of the script; what it returned, in words."""
    if call == "submit_store":
        worker.submit_store(1, _gspec([5, 9, 1]), CPULoadStoreSpec([1]))
        return "queued"
    if call == "submit_load":
        worker.submit_load(2, CPULoadStoreSpec([1]), _gspec([20, 21, 22]))
        return "queued"
    if call == "get_finished":
        return _results(list(worker.get_finished())) or "no result yet"
    if call == "wait":
        try:
            worker.wait({2}, timeout=1.0)
        except DeadlineExceeded:
            return "`DeadlineExceeded` (the load never completes)"
        return "returns; then " + (_results(list(worker.get_finished())) or "no result")
    report = worker.shutdown()
    said = [] if report.device_sync in ("not_needed", "ok") else [f"device sync {report.device_sync}"]
    if report.errors:
        said.append("logged in the report's `errors`" + (" and `leaked`" if report.leaked else ""))
    if report.region != "released":
        said.append(f"region {report.region}")
    return "completes: " + ", ".join(said) if said else "completes cleanly"


@dataclasses.dataclass
class _Script:
    """One run of the script: the fault points each call consulted, what each call said, and where the armed fault
    first fired (None: nowhere)."""

    consulted: dict[str, set[str]]
    said: dict[str, str]
    fired_at: str | None = None


def _run(make: Callable[..., WorkerFacade], fault: Fault | None, at: str) -> _Script:
    """The script with ``fault`` armed just before the call ``at``."""
    # R13: device_sync is consulted only by the device-level proof, which a shutdown runs only after a transfer it
    # could not prove: load job 2 hangs in those runs.
    plan = FaultPlan([Fault("copy", "hang", direction="load", job_id=2)]
                     if fault is not None and fault.point == "device_sync" else [])
    be = SimBackend(faults=plan, hang_horizon=5.0)
    script = _Script({call: set() for call in CALLS}, {})
    current = ["create_worker"]

    def on_call(point: str, tag: object) -> None:
        if point in CONSULTED:
            script.consulted[current[0]].add(CONSULTED[point])

    be.on_call = on_call
    gpu = [be.empty_device((64, 512)) for _ in range(2)]
    worker: WorkerFacade | None = None
    armed = len(plan.fired)
    for call in CALLS:
        current[0] = call
        if call == at and fault is not None:
            plan.add(fault)
            armed = len(plan.fired)
        try:
            if call == "create_worker":
                worker = make(be, gpu, _LAYOUT, blocks_per_chunk=3, num_cpu_chunks=16,
                              policy=ShutdownPolicy(timeout=0.5))
                said = "built"
            else:
                assert worker is not None  # Invariant: a failed create ends the script below
                said = _step(call, worker)
        except Exception as exc:  # what the call raised is the measurement
            said = _describe(exc)
            if call == "create_worker":
                said = "refused: " + said.removeprefix("raises ") + " (no worker)"
        script.said[call] = said
        if script.fired_at is None and fault is not None and fault in plan.fired[armed:]:
            script.fired_at = call
        if worker is None:
            break
    return script


def measure() -> list[Cell]:
    """Every (point, kind, call) cell where the fault fires, measured on each worker (``Cell.worker``).

    An error is armed before each call that consults its point, and the cell is what that call did. A stall
    (``hang``, ``slow``) at a transfer point is armed before ``submit_store`` and selects every transfer submitted
    from then on; its cells are what each call from the submission on did. ``device_sync``'s hang is armed before
    ``shutdown``.
    """
    cells: list[Cell] = []
    with quiet():
        for name, make in _WORKERS.items():
            consulted = _run(make, None, "").consulted
            for point in POINTS:
                for kind in _kinds(point):
                    if kind == "error":
                        for call in CALLS:
                            if point in consulted[call] or point == "device_sync":
                                run = _run(make, _fault(point, kind), call)
                                if run.fired_at == call:
                                    cells.append(Cell(point, kind, call, run.said[call], name))
                        continue
                    at = "shutdown" if point == "device_sync" else "submit_store"
                    run = _run(make, _fault(point, kind), at)
                    if run.fired_at is not None:
                        cells += [Cell(point, kind, call, run.said[call], name)
                                  for call in CALLS[CALLS.index(at):] if call in run.said]
    return cells


def _cell(cells: list[Cell], point: str, kind: str, call: str) -> str:
    """One table cell: the outcome both workers share, or each worker's (they differ only in where a point is
    consulted: the engine pools descriptors and events and frees them at shutdown, the reference per transfer)."""
    seen = {c.worker: c.outcome for c in cells if (c.point, c.kind, c.call) == (point, kind, call)}
    if not seen:
        return "—"
    if len(seen) == len(_WORKERS) and len(set(seen.values())) == 1:
        return next(iter(seen.values()))
    return "; ".join(f"{worker}: {seen.get(worker, '—')}" for worker in _WORKERS)


def render(cells: list[Cell] | None = None) -> str:
    """The generated block: one row per (point, kind), one cell per call where the fault fires."""
    cells = measure() if cells is None else cells
    lines = [BEGIN, "", "| point | kind | " + " | ".join(f"`{c}`" for c in CALLS) + " |",
             "|---|---|" + "---|" * len(CALLS)]
    for point in POINTS:
        for kind in _kinds(point):
            lines.append(f"| `{point}` | `{kind}` | " + " | ".join(_cell(cells, point, kind, call) for call in CALLS)
                         + " |")
    return "\n".join([*lines, "", END])


def _block(text: str) -> tuple[int, int]:
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"docs/simulator.md has no {BEGIN} ... {END} block")
    return begin, end + len(END)


def check(root: pathlib.Path) -> bool:
    """Whether docs/simulator.md's block is what :func:`render` measures now."""
    text = (root / "docs" / "simulator.md").read_text()
    begin, end = _block(text)
    return text[begin:end] == render()


def write(root: pathlib.Path) -> None:
    """Regenerate docs/simulator.md's block."""
    path = root / "docs" / "simulator.md"
    text = path.read_text()
    begin, end = _block(text)
    path.write_text(text[:begin] + render() + text[end:])


if __name__ == "__main__":  # python -m kvoffload_ref.docgen.fault_table [--write]
    if "--write" in sys.argv:
        write(pathlib.Path.cwd())
    else:
        sys.stdout.write(render() + "\n")
