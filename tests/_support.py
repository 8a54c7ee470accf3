"""Small builders shared by the worker, handler and region tests (not a test module)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, settings

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.testing.adapter import WorkerFactory, reference_factory, reference_worker_factory

PAGE = 512
GPU_BLOCKS = 64
CPU_CHUNKS = 16
BPC = 3

#: The two workers the kit's checks run on (the engine, ``create_worker``, and the normative reference,
#: ``create_reference_worker``): id -> (factory, its ``module:callable`` name). Parametrize over ``WORKERS``.
FACTORIES: dict[str, tuple[WorkerFactory, str]] = {
    "engine": (reference_factory, "kvoffload_ref.testing.adapter:reference_factory"),
    "reference": (reference_worker_factory, "kvoffload_ref.testing.adapter:reference_worker_factory"),
}
WORKERS = list(FACTORIES)
#: The two workers' constructors by the same ids (``make_worker(kind=...)``).
CREATE: dict[str, Any] = {"engine": kv.create_worker, "reference": kv.create_reference_worker}


def small_layout(num_tensors: int = 2, page: int = PAGE) -> kv.KVCacheLayout:
    """One group over ``num_tensors`` tensors of ``page``-byte pages (the reference's worked example)."""
    return kv.KVCacheLayout(tensor_page_bytes=(page,) * num_tensors,
                            groups=(tuple(kv.LayerRef(t, page) for t in range(num_tensors)),))


def patterned_gpu(be: Any, layout: kv.KVCacheLayout, blocks: int = GPU_BLOCKS, seed: int = 0) -> list[Any]:
    """One device array per tensor filled with random bytes."""
    rng = np.random.default_rng(seed)
    return [be.from_host(rng.integers(0, 256, (blocks, rb), dtype=np.uint8)) for rb in layout.tensor_page_bytes]


def make_worker(be: Any = None, *, layout: kv.KVCacheLayout | None = None, timeout: float = 1.0,
                on_unproven: str = "quarantine", bpc: int = BPC, kind: str = "engine",
                **kwargs: Any) -> tuple[Any, kv.CPUOffloadingWorker, list[Any]]:
    """A sim backend (unless given), patterned GPU tensors and a worker (``kind``: a ``CREATE`` id) over them."""
    be = be if be is not None else SimBackend()
    layout = layout or small_layout()
    gpu = patterned_gpu(be, layout)
    policy = kv.ShutdownPolicy(timeout=timeout, on_unproven=on_unproven)
    worker = CREATE[kind](be, gpu, layout, blocks_per_chunk=bpc,
                          num_cpu_chunks=kwargs.pop("num_cpu_chunks", CPU_CHUNKS), policy=policy, **kwargs)
    return be, worker, gpu


def gspec(ids: Sequence[int], index: int = 0) -> kv.GPULoadStoreSpec:
    """A single-group GPU spec."""
    return kv.GPULoadStoreSpec(list(ids), group_sizes=(len(ids),), block_indices=(index,))


def cspec(ids: Sequence[int]) -> kv.CPULoadStoreSpec:
    return kv.CPULoadStoreSpec(list(ids))


@contextmanager
def captured(caplog: Any, level: int = logging.DEBUG) -> Iterator[Any]:
    with caplog.at_level(level, logger="kvoffload_ref"):
        yield caplog


def messages(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records]



@contextmanager
def at_call(be: Any, point: str, action: Callable[[], None], *, nth: int = 1) -> Iterator[None]:
    """Run ``action`` at the start of the ``nth`` backend call named ``point`` (the sim's on_call hook)."""
    seen = [0]

    def hook(name: str, tag: object) -> None:
        if name == point:
            seen[0] += 1
            if seen[0] == nth:
                action()

    be.on_call = hook
    try:
        yield
    finally:
        be.on_call = None


def raise_interrupt() -> None:
    """An ``at_call`` action: the Ctrl-C that lands at that call."""
    raise KeyboardInterrupt

def assert_accounted(be: Any, report: kv.ShutdownReport) -> None:
    """R16: nothing live after shutdown; what is not released is listed as quarantined or leaked."""
    assert be.ledger.live() == {}
    assert be.ledger.quarantined() == dict(report.quarantined)
    assert be.ledger.leaked() == dict(report.leaked)

#: The CI budget the kit must catch a deliberately wrong worker in (examples of up to 50 steps).
CATCH_BUDGET = 200


def catch_budget(examples: int = CATCH_BUDGET) -> settings:
    """The settings a test that must catch a wrong worker runs the machine under: derandomized, generation only,
    no database, no shrinking, stop at the first bug."""
    return settings(max_examples=examples, stateful_step_count=50, derandomize=True, database=None, deadline=None,
                    phases=[Phase.generate], report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
