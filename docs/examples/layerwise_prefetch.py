"""Layer-wise prefetch: load each layer's KV from CPU while the previous layer computes (R23, R22, R20).

A decode step over ``LAYERS`` layers whose KV cache was offloaded to CPU memory. Every layer's load is queued up
front (they run one after another on the worker's load stream); the model's compute stream is made to wait *on the
device* for layer i's load with ``worker.order_after([job])`` just before layer i's kernel is enqueued, so the host
never blocks and layer i+1's load runs under layer i's compute. The new KV each layer writes is stored back behind
that compute (a store waits for the compute work queued when it is submitted, R4).

On the simulated device the figures are the sim's virtual clock: how long the loads and stores took, how long the
compute took, how long the whole step took, hence how much of the transfer time was hidden under compute. The race
detector (R20) must report nothing; run with ``--no-order`` to drop the ``order_after`` line and see what it reports.

Usage::

    python docs/examples/layerwise_prefetch.py            # the simulated device
    python docs/examples/layerwise_prefetch.py --no-order # the same without order_after: a dma_race per layer
    python docs/examples/layerwise_prefetch.py --backend cupy   # a real GPU (CuPy), with torch tensors if present
    python docs/examples/layerwise_prefetch.py --profile h200 --trace step.json  # the H200 cost model; a timeline

The results only say what the device did: use a layer's KV only once its load is reported ``success=True`` and
recompute ``invalid_blocks`` of a load that failed (``kvoffload_ref.poisoned_gpu_blocks``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload_ref import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVCacheLayout,
    LayerRef,
    create_worker,
    get_backend,
    poisoned_gpu_blocks,
)
from kvoffload_ref.backends.sim import SimBackend

LAYERS = 8
PAGE = 64 * 1024  # bytes of one layer's KV for one block
BLOCKS = 16  # blocks of the sequence
GPU_BLOCKS = 64
COMPUTE_SECONDS = 60e-6  # one layer's kernel, on the simulated device's clock


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What one decode step did, read from the device's clock (virtual on the sim)."""

    loads: float  # seconds the layer loads took, summed (their transfer_time)
    stores: float  # seconds the stores of the new KV took, summed
    compute: float  # seconds of compute, summed
    step: float  # seconds from the first submission to the last store proven
    violations: tuple[str, ...]  # the race detector's findings (sim only)
    poisoned: tuple[int, ...]  # GPU blocks failed loads left undefined

    @property
    def hidden(self) -> float:
        """The fraction of the transfer time that ran under compute: (transfers + compute - step) / transfers."""
        transfers = self.loads + self.stores
        return max(0.0, min(1.0, (transfers + self.compute - self.step) / transfers)) if transfers else 0.0


def layout() -> KVCacheLayout:
    """One KV-cache group per layer, so that one transfer moves one layer."""
    return KVCacheLayout(tensor_page_bytes=(PAGE,) * LAYERS, groups=[(LayerRef(i, PAGE),) for i in range(LAYERS)])


def layer_spec(layer: int, blocks: Sequence[int]) -> GPULoadStoreSpec:
    """The GPU side of one layer's transfer: ``blocks`` in that layer's group, no block in the others."""
    sizes = [len(blocks) if g == layer else 0 for g in range(LAYERS)]
    return GPULoadStoreSpec(list(blocks), group_sizes=sizes, block_indices=[0] * LAYERS)


def run_step(backend: Any, gpu: Sequence[Any], *, order: bool = True, compute: Any = None,
             stream: object = "model", compute_seconds: float = COMPUTE_SECONDS) -> StepFigures:
    """One decode step: offload the prompt's KV, then prefetch it layer by layer under compute.

    Args:
        backend: a kvoffload_ref backend. gpu: one device array per layer, (GPU_BLOCKS, PAGE) bytes.
        order: make compute wait for each layer's load with ``order_after`` (False: the racy version).
        compute: ``compute(layer, rows)`` enqueues one layer's kernel on ``stream`` (None: the sim's compute
            write, ``compute_seconds`` long). stream: the model's compute stream (the sim: its name).
        compute_seconds: the length of one layer's kernel, for the figures (0: unknown).

    Returns:
        The step's figures.
    """
    rows = list(range(BLOCKS))
    with create_worker(backend, gpu, layout(), blocks_per_chunk=1, num_cpu_chunks=2 * LAYERS * BLOCKS,
                       compute_stream=stream) as worker:
        for layer in range(LAYERS):  # the prompt's KV, offloaded earlier: CPU chunks layer * BLOCKS + i
            worker.submit_store(layer, layer_spec(layer, rows), CPULoadStoreSpec(_chunks(layer)))
        worker.wait(range(LAYERS))
        worker.get_finished()
        started = backend.monotonic()
        loads = [100 + layer for layer in range(LAYERS)]
        for layer, job in enumerate(loads):  # all queued up front: the load stream runs them back to back
            worker.submit_load(job, CPULoadStoreSpec(_chunks(layer)), layer_spec(layer, rows))
        for layer, job in enumerate(loads):
            if order:
                worker.order_after([job])  # R23: compute waits for this layer's load, on the device
            if compute is None:  # the sim: a kernel that reads the layer's KV and writes its new entries
                backend.enqueue_compute_write(gpu[layer], rows, value=layer + 1, delay=compute_seconds,
                                              stream=stream)
            else:
                compute(layer, rows)
            # the layer's new KV, stored behind its compute (R4: a store waits for the compute queued so far)
            worker.submit_store(200 + layer, layer_spec(layer, rows), CPULoadStoreSpec(_chunks(LAYERS + layer)))
        worker.wait([*loads, *(200 + layer for layer in range(LAYERS))])
        step = backend.monotonic() - started
        results = worker.get_finished()
    took = {r.job_id: r.transfer_time or 0.0 for r in results}
    violations = tuple(f"{v.kind}: {v.detail}" for v in getattr(backend, "violations", []))
    return StepFigures(loads=sum(took.get(j, 0.0) for j in loads), stores=sum(took.get(200 + i, 0.0)
                                                                              for i in range(LAYERS)),
                       compute=compute_seconds * LAYERS, step=step, violations=violations,
                       poisoned=poisoned_gpu_blocks(results))


def _chunks(slot: int) -> list[int]:
    return [slot * BLOCKS + i for i in range(BLOCKS)]


def sim_device(seed: int = 0, **options: Any) -> tuple[SimBackend, list[Any]]:
    """A simulated device (``SimBackend(**options)``: profile=, trace=) with one filled KV tensor per layer."""
    backend = SimBackend(**options)
    rng = np.random.default_rng(seed)
    return backend, [backend.from_host(rng.integers(0, 256, (GPU_BLOCKS, PAGE), dtype=np.uint8))
                     for _ in range(LAYERS)]


def gpu_step(order: bool, trace: str | None = None) -> StepFigures:  # pragma: no cover - needs a GPU
    """The same step on the CuPy backend: torch tensors and a torch stream when torch is importable (else CuPy
    arrays and a CuPy stream); each layer's kernel adds 1 to its loaded blocks. ``trace``: write the copies'
    timeline (CUDA events) there."""
    backend = get_backend("cupy")
    if trace is not None:
        backend.start_trace()
    try:
        import torch  # noqa: PLC0415  # optional: only on a GPU machine

        tensors: list[Any] = [torch.randint(0, 256, (GPU_BLOCKS, PAGE), dtype=torch.uint8, device="cuda")
                              for _ in range(LAYERS)]
        model: Any = torch.cuda.Stream()

        def compute(layer: int, rows: list[int]) -> None:
            with torch.cuda.stream(model):
                tensors[layer][rows] += 1
    except ImportError:
        import cupy  # noqa: PLC0415  # optional: only on a GPU machine

        tensors = [cupy.random.randint(0, 256, (GPU_BLOCKS, PAGE), dtype=cupy.uint8) for _ in range(LAYERS)]
        model = cupy.cuda.Stream(non_blocking=True)

        def compute(layer: int, rows: list[int]) -> None:
            with model:
                tensors[layer][rows] += 1

    figures = run_step(backend, tensors, order=order, compute=compute, stream=model, compute_seconds=0.0)
    if trace is not None:
        backend.write_trace(trace)
        backend.stop_trace()
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    """Run one step and print its figures. Exit status 0 when the step is clean (or, with --no-order, when the race
    detector flagged it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-order", action="store_true", help="drop order_after (the racy version)")
    parser.add_argument("--backend", choices=("sim", "cupy"), default="sim")
    parser.add_argument("--profile", choices=("simple", "h200", "h100"), default="simple",
                        help="the simulated device's cost profile")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write the step's timeline as Chrome trace-event JSON (Perfetto)")
    args = parser.parse_args(argv)
    if args.backend == "cupy":  # pragma: no cover - needs a GPU
        figures = gpu_step(order=not args.no_order, trace=args.trace)
    else:
        backend, gpu = sim_device(profile=args.profile, trace=args.trace is not None)
        figures = run_step(backend, gpu, order=not args.no_order)
        if args.trace is not None:
            backend.write_trace(args.trace)
    clock = "virtual" if args.backend == "sim" else "device"
    print(f"{LAYERS} layers x {BLOCKS} blocks x {PAGE // 1024} KiB, {'with' if not args.no_order else 'WITHOUT'} "
          f"order_after ({clock} clock):")
    hidden = (f"{figures.hidden:.0%} of the transfer time hidden under compute" if figures.compute
              else "compute time unknown")
    print(f"  loads {figures.loads * 1e6:.1f} us + stores {figures.stores * 1e6:.1f} us, compute "
          f"{figures.compute * 1e6:.1f} us, step {figures.step * 1e6:.1f} us: {hidden}")
    print(f"  race detector: {len(figures.violations)} violation(s)")
    for line in figures.violations[:3]:
        print(f"    {line}")
    if figures.poisoned:
        print(f"  recompute GPU blocks {list(figures.poisoned)} (failed loads)")
    return 0 if bool(figures.violations) == args.no_order else 1


if __name__ == "__main__":
    sys.exit(main())
