"""A running engine survives its own stuck loads: deadlines, held blocks, fresh streams (R26, R27, R28, R22).

An engine's loop loads each request's offloaded KV back into GPU blocks with a deadline and polls the worker once
per step (a step is one forward pass of the model, here a fixed slice of the simulated device's virtual clock).
What it does with each result:

* **success** -- the request's KV is in its GPU blocks: it is ready.
* **failed, reason "deadline"** (or "cancel", or an R5 device error) -- the GPU blocks the load was to write are
  poisoned (R22, ``kv.poisoned_gpu_blocks``) and, since the copy may still run, *held* (R27): the engine parks them
  (out of its free pool) and recomputes the request's KV into fresh blocks at once.
* **failed, reason "behind"** -- the load never ran: it was queued behind the expired one on the same stream. Its
  CPU copy is intact, so the engine loads it again into fresh blocks; the worker queues that on a fresh stream (R28),
  not behind the stuck one.
* **a released hold** (``worker.take_released()``) -- a late copy was observed done: its parked blocks go back to
  the free pool, first in line, and the next request reuses them.

Part 1 hangs one load for good (``kv.Fault("copy", "hang", ...)``): it expires, the load behind it is retried on a
fresh stream, new requests keep being served, a naive reuse of a held block is refused (``kv.BlocksHeldError``),
and the shutdown keeps what the hung copy may touch. Part 2 runs on a slow link (``SimBackend(latency=...,
pinned_bandwidth=1e6)``: a load takes milliseconds of virtual time) with a deadline shorter than a load: the load
expires, its late copy lands a few steps later, ``take_released()`` hands its blocks back and the next request
loads into them. Every figure is the simulated device's virtual clock; the script asserts what it prints.

Usage::

    python docs/examples/running_engine.py              # the engine (kv.create_worker)
    python docs/examples/running_engine.py --reference  # the same on the normative reference worker
    python docs/examples/running_engine.py --in-place   # recompute into held blocks: the race detector flags it
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend

PAGE = 512  # bytes of one tensor's page of one block (two tensors: 1 KiB of KV per block)
LAYOUT = kv.KVCacheLayout(tensor_page_bytes=(PAGE, PAGE), groups=((kv.LayerRef(0, PAGE), kv.LayerRef(1, PAGE)),))
GPU_BLOCKS = 64
CPU_CHUNKS = 32  # one GPU block per CPU chunk (blocks_per_chunk=1)
BLOCKS = 4  # blocks of each request's offloaded prefix
FIRST_FREE = 16  # GPU blocks 0..15 hold the prefixes that were offloaded; the engine allocates from 16 up
RECOMPUTED = 0x5A  # the byte the simulated prefill writes when it recomputes a request's KV
STEP = 1e-3  # virtual seconds of one forward pass
Worker = kv.CPUOffloadingWorker | kv.ReferenceWorker
Create = Callable[..., Worker]  # kv.create_worker (the engine) or kv.create_reference_worker


def prefix(request: int) -> list[int]:
    """The GPU blocks request ``request`` computed its prefix in, and (blocks_per_chunk=1) its CPU chunks."""
    return list(range(request * BLOCKS, (request + 1) * BLOCKS))


def gspec(blocks: Sequence[int]) -> kv.GPULoadStoreSpec:
    """The GPU side of a transfer: ``blocks`` of the layout's one KV group."""
    return kv.GPULoadStoreSpec(list(blocks), group_sizes=(len(blocks),), block_indices=(0,))


@dataclasses.dataclass
class Loading:
    """A load in flight: the request it serves, its offloaded prefix and the GPU blocks it writes."""

    name: str
    request: int
    blocks: list[int]


class Engine:
    """The engine side: a GPU block pool, the loads in flight and one ``step`` of its loop.

    Args:
        backend: the simulated device. gpu: its KV tensors. worker: the offloading worker over them.
        step_seconds: virtual seconds one forward pass takes. deadline: seconds a load may run on the device.
        in_place: recompute a failed load's request into the very blocks the late copy may still write (the
            hazard R27 guards against: the race detector flags it) instead of into fresh ones.
    """

    def __init__(self, backend: SimBackend, gpu: list[Any], worker: Worker, *,
                 step_seconds: float, deadline: float, in_place: bool = False) -> None:
        self.backend, self.gpu, self.worker = backend, gpu, worker
        self.step_seconds, self.deadline, self.in_place = step_seconds, deadline, in_place
        self.free = list(range(FIRST_FREE, GPU_BLOCKS))  # the pool, allocated from the front
        self.parked: set[int] = set()  # poisoned blocks a late copy may still write: never handed out
        self.ready: dict[str, list[int]] = {}  # request -> the GPU blocks holding its KV
        self.recomputed: list[str] = []  # requests whose KV was recomputed rather than loaded
        self.loading: dict[int, Loading] = {}  # job id -> the load
        self.next_job, self.steps, self.started = 10, 0, backend.monotonic()
        self.events: list[tuple[int, str, str, int, tuple[int, ...]]] = []  # (step, what, request, job, blocks)
        self.log: list[str] = []  # the same, as text

    def load(self, name: str, request: int, deadline: float | None = None) -> int:
        """Load a request's offloaded prefix into fresh GPU blocks, with a deadline; returns the job id."""
        job, blocks, deadline = self.next_job, self.allocate(), deadline or self.deadline
        self.next_job += 1
        self.worker.submit_load(job, kv.CPULoadStoreSpec(prefix(request)), gspec(blocks), deadline=deadline, tag=name)
        self.loading[job] = Loading(name, request, blocks)
        self.say("queued", name, job, blocks, f"load queued into GPU {blocks}, deadline {deadline * 1e3:g} ms")
        return job

    def step(self) -> None:
        """One forward pass, then the worker's results and released holds."""
        self.backend.clock_advance(self.step_seconds)  # the model runs
        self.steps += 1
        for result in self.worker.get_finished():
            load = self.loading.pop(result.job_id)
            if result.success:
                self.ready[load.name] = load.blocks
                self.say("loaded", load.name, result.job_id, load.blocks, f"loaded into GPU {load.blocks}")
                continue
            poisoned = kv.poisoned_gpu_blocks([result])  # R22: what the load was to write
            error = result.error
            if self.in_place and not (isinstance(error, kv.TransferExpired) and error.reason == "behind"):
                self.ready[load.name] = self.recompute(load.blocks)  # WRONG: the late copy may still write them
                self.recomputed.append(load.name)
                self.say("in place", load.name, result.job_id, poisoned, f"failed: recompute in place, GPU "
                         f"{list(poisoned)} (a race with the late copy)")
                continue
            self.parked |= set(poisoned)  # R27: held while its copy may still run: never hand them out
            if isinstance(error, kv.TransferExpired) and error.reason == "behind":  # it never ran: load it again
                self.say("behind", load.name, result.job_id, poisoned,
                         f"failed, behind job {error.ahead}: GPU {list(poisoned)} parked; load it again")
                self.load(load.name, load.request)  # on a fresh stream, not behind the stuck one (R28)
            else:  # "deadline", "cancel" or a device error (R5): its copy may be stuck; recompute elsewhere
                why = error.reason if isinstance(error, kv.TransferExpired) else type(error).__name__
                self.ready[load.name] = self.recompute()
                self.recomputed.append(load.name)
                self.say(why, load.name, result.job_id, poisoned,
                         f"failed ({why}): GPU {list(poisoned)} parked; recompute into GPU {self.ready[load.name]}")
        for hold in self.worker.take_released():  # R27: each ended hold once: its blocks may be used again
            if hold.direction != "load":  # a store's hold frees CPU chunks: the CPU allocator's business
                continue
            if back := [b for b in hold.gpu_blocks if b in self.parked]:
                self.parked -= set(back)
                self.free[:0] = back  # first in line
                self.say("released", str(hold.tag), hold.job_id, back,
                         f"hold released (its late copy landed): GPU {back} free again")

    def allocate(self) -> list[int]:
        """``BLOCKS`` blocks from the front of the pool."""
        blocks, self.free = self.free[:BLOCKS], self.free[BLOCKS:]
        return blocks

    def recompute(self, blocks: list[int] | None = None) -> list[int]:
        """The simulated prefill: a kernel on the model's stream writes the request's KV into ``blocks`` (None:
        fresh ones); returns them."""
        blocks = self.allocate() if blocks is None else blocks
        for tensor in self.gpu:
            self.backend.enqueue_compute_write(tensor, blocks, value=RECOMPUTED, delay=self.step_seconds / 4,
                                               stream="model")
        return blocks

    def run_until(self, names: Sequence[str], max_steps: int = 50) -> None:
        """Step until every listed request is ready and no load is in flight."""
        while not (all(n in self.ready for n in names) and not self.loading):
            if self.steps >= max_steps:
                raise AssertionError(f"not ready after {max_steps} steps: {self.log}")
            self.step()

    def say(self, what: str, name: str, job: int, blocks: Sequence[int], text: str) -> None:
        """Record an event of the loop (and its line of text, with the step and the time since the engine began)."""
        self.events.append((self.steps, what, name, job, tuple(blocks)))
        elapsed = (self.backend.monotonic() - self.started) * 1e3
        self.log.append(f"step {self.steps:2d} (t={elapsed:5.2f} ms): {name} (job {job}) {text}")


def sim_worker(backend: SimBackend, create: Create = kv.create_worker
               ) -> tuple[list[Any], Worker, list[np.ndarray]]:
    """Random KV in GPU blocks 0..15, a worker over it (``create``: ``kv.create_worker``, the engine, or
    ``kv.create_reference_worker``, the normative reference) and the four prefixes offloaded (CPU chunks 0..15)."""
    rng = np.random.default_rng(0)
    gpu = [backend.from_host(rng.integers(0, 256, (GPU_BLOCKS, PAGE), dtype=np.uint8)) for _ in range(2)]
    worker = create(backend, gpu, LAYOUT, blocks_per_chunk=1, num_cpu_chunks=CPU_CHUNKS,
                              compute_stream="model", policy=kv.ShutdownPolicy(timeout=0.05))
    for request in range(4):
        worker.submit_store(request, gspec(prefix(request)), kv.CPULoadStoreSpec(prefix(request)))
    worker.wait(range(4))
    expect(all(r.success for r in worker.get_finished()), "the prefixes offloaded")
    return gpu, worker, [backend.to_host(t) for t in gpu]


def holds_its_kv(engine: Engine, origin: list[np.ndarray], name: str, request: int) -> bool:
    """Whether a ready request's GPU blocks hold its KV: its offloaded prefix, or the recomputed bytes."""
    rows = engine.ready[name]
    for tensor, before in zip(engine.gpu, origin, strict=True):
        want = np.full((BLOCKS, PAGE), RECOMPUTED, np.uint8) if name in engine.recomputed else before[prefix(request)]
        if not np.array_equal(engine.backend.to_host(tensor)[rows], want):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one part did."""

    events: tuple[tuple[int, str, str, int, tuple[int, ...]], ...]  # the engine's (step, what, request, job, blocks)
    log: tuple[str, ...]  # the same, one line of text each
    held: kv.HeldBlocks  # worker.held() at the end of the run
    refused: str  # the BlocksHeldError of the naive reuse ("" when none was tried)
    correct: bool  # every ready request's GPU blocks hold its KV
    report: kv.ShutdownReport
    violations: tuple[str, ...]  # the race detector's findings (R20)


HUNG_JOB = 11  # request "b"'s load


def hung_load(create: Create = kv.create_worker) -> Outcome:
    """Part 1: request b's load hangs on the device for good."""
    backend = SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=HUNG_JOB)]))
    gpu, worker, origin = sim_worker(backend, create)
    engine = Engine(backend, gpu, worker, step_seconds=STEP, deadline=4.5e-3)
    for name, request in (("a", 0), ("b", 1), ("c", 2)):  # jobs 10, 11 (hangs), 12 (queued behind it)
        engine.load(name, request)
    engine.run_until(["a", "b", "c"])
    engine.load("d", 3)  # a new request, served while the hung copy still runs
    engine.run_until(["d"])
    held = worker.held()
    try:  # a naive engine would hand b's poisoned blocks out again: refused, nothing changed
        worker.submit_load(99, kv.CPULoadStoreSpec(prefix(3)), gspec(sorted(engine.parked)[:BLOCKS]))
    except kv.BlocksHeldError as exc:
        refused = str(exc)
    else:
        raise AssertionError("a load into a held block was accepted")
    correct = all(holds_its_kv(engine, origin, n, r) for n, r in (("a", 0), ("b", 1), ("c", 2), ("d", 3)))
    report = worker.shutdown()
    return Outcome(tuple(engine.events), tuple(engine.log), held, refused, correct, report,
                   tuple(f"{v.kind}: {v.detail}" for v in backend.violations))


def slow_copy(create: Create = kv.create_worker, *, in_place: bool = False) -> Outcome:
    """Part 2: a slow link; request a's load outlives its deadline, lands later, and its blocks are reused
    (``in_place``: the engine recomputes a's KV into the blocks the late copy still writes, the wrong way)."""
    backend = SimBackend(latency=1e-5, pinned_bandwidth=1e6)  # 4 KiB per load: about 4.1 ms of virtual time
    gpu, worker, origin = sim_worker(backend, create)
    engine = Engine(backend, gpu, worker, step_seconds=STEP, deadline=1.5e-3, in_place=in_place)
    engine.load("a", 0)  # a 1.5 ms deadline for a 4 ms copy: it expires while the copy runs on
    engine.run_until(["a"])
    held = worker.held()
    while engine.parked and engine.steps < 50:  # the late copy lands; the step that observes it hands the hold out
        engine.step()
    engine.load("b", 1, deadline=10e-3)  # allocated first: a's old blocks
    engine.run_until(["b"])
    correct = all(holds_its_kv(engine, origin, n, r) for n, r in (("a", 0), ("b", 1)))
    report = worker.shutdown()
    return Outcome(tuple(engine.events), tuple(engine.log), held, "", correct, report,
                   tuple(f"{v.kind}: {v.detail}" for v in backend.violations))


def _ids(first: int) -> tuple[int, ...]:
    return tuple(range(first, first + BLOCKS))


#: What part 1 must do, step by step: (step, what, request, job, GPU blocks). Job 11's deadline counts from the
#: poll that first saw it started (step 1, R26), so it expires at step 6, not 5; job 12 behind it fails with it,
#: and its second try (job 13) and request d (job 14) run on a fresh stream while job 11's copy still hangs (R28).
HUNG_EVENTS = (
    (0, "queued", "a", 10, _ids(16)), (0, "queued", "b", 11, _ids(20)), (0, "queued", "c", 12, _ids(24)),
    (1, "loaded", "a", 10, _ids(16)),
    (6, "deadline", "b", 11, _ids(20)), (6, "behind", "c", 12, _ids(24)), (6, "queued", "c", 13, _ids(32)),
    (7, "loaded", "c", 13, _ids(32)), (7, "queued", "d", 14, _ids(36)), (8, "loaded", "d", 14, _ids(36)),
)
#: What part 2 must do: job 10 expires at step 3 (1.5 ms after step 1's poll saw it start); its copy (about 4.1 ms)
#: lands before step 5's poll, which ends its hold (R27); request b then loads into the same blocks.
SLOW_EVENTS = (
    (0, "queued", "a", 10, _ids(16)), (3, "deadline", "a", 10, _ids(16)), (5, "released", "a", 10, _ids(16)),
    (5, "queued", "b", 11, _ids(16)), (10, "loaded", "b", 11, _ids(16)),
)


def describe(held: kv.HeldBlocks) -> str:
    """``worker.held()`` as text: what is held for any access, what against writes only (R27)."""
    parts = []
    for what, ids, writes_only in (("GPU", held.gpu_blocks, held.gpu_blocks_writes_only),
                                   ("CPU", held.cpu_chunks, held.cpu_chunks_writes_only)):
        if any_access := [i for i in ids if i not in writes_only]:
            parts.append(f"{what} {any_access} for any access")
        if writes_only:
            parts.append(f"{what} {list(writes_only)} against writes only")
    return "; ".join(parts) or "nothing"


def _in_place(create: Create) -> int:
    """Part 2 done wrong: the race detector names the recompute and the late copy (exit 0 when it does)."""
    print("part 2, recomputing in place: a slow link (1 MB/s: a load takes about 4.1 ms), "
          f"{STEP * 1e3:g} ms steps")
    wrong = slow_copy(create, in_place=True)
    for line in wrong.log:
        print(f"  {line}")
    print(f"  every ready request holds its KV: {wrong.correct}")
    print(f"  race detector: {len(wrong.violations)} violation(s)")
    for line in wrong.violations[:2]:
        print(f"    {line}")
    expect(not wrong.correct and len(wrong.violations) > 0, "the late copy to overwrite the recompute, flagged")
    return 0


def expect(condition: bool, what: str) -> None:
    """The example checks what it prints (``assert`` would vanish under ``python -O``)."""
    if not condition:
        raise AssertionError(f"running_engine: expected {what}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run both parts, print what happened and check it. Exit status 0 when everything happened as printed.

    Raises:
        AssertionError: the worker did not do what this example documents.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true", help="run on the normative reference worker")
    parser.add_argument("--in-place", action="store_true",
                        help="part 2 only, recomputing into the blocks the late copy still writes (the race)")
    args = parser.parse_args(argv)
    create = kv.create_reference_worker if args.reference else kv.create_worker
    if args.in_place:
        return _in_place(create)
    print(f"part 1: request b's load hangs on the device ({STEP * 1e3:g} ms steps, virtual clock)")
    one = hung_load(create)
    for line in one.log:
        print(f"  {line}")
    print(f"  held: {describe(one.held)}")
    print(f"  refused: {one.refused.split(';')[0]}")
    print(f"  every ready request holds its KV: {one.correct}")
    print(f"  shutdown: region {one.report.region}, retired load streams kept {one.report.load.retired_streams}, "
          f"race detector {len(one.violations)} violation(s)")
    expect(one.events == HUNG_EVENTS, f"part 1's events {HUNG_EVENTS}, got {one.events}")
    expect(one.held == kv.HeldBlocks(_ids(20) + _ids(24), _ids(4) + _ids(8), (), _ids(4) + _ids(8)),
           f"b's and c's blocks held, got {one.held}")
    expect("would write GPU blocks [20, 21, 22, 23]" in one.refused, "the reuse of b's blocks refused")
    expect(one.correct and one.violations == (), "correct bytes and no race")
    expect(one.report.region == "quarantined" and one.report.load.retired_streams == 1,
           "the hung copy's memory and stream kept at shutdown")

    print(f"part 2: a slow link (1 MB/s: a load takes about 4.1 ms), {STEP * 1e3:g} ms steps")
    two = slow_copy(create)
    for line in two.log:
        print(f"  {line}")
    print(f"  held after the expiry: {describe(two.held)}")
    print(f"  every ready request holds its KV: {two.correct}")
    print(f"  shutdown: region {two.report.region}, race detector {len(two.violations)} violation(s)")
    expect(two.events == SLOW_EVENTS, f"part 2's events {SLOW_EVENTS}, got {two.events}")
    expect(two.held == kv.HeldBlocks(_ids(16), _ids(0), (), _ids(0)), f"a's blocks held, got {two.held}")
    expect(two.correct and two.violations == (), "correct bytes and no race")
    expect(two.report.region == "released", "nothing kept once the late copy landed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
