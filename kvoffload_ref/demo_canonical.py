"""The demo's canonical-layout act (R24): a TP=4 model stores in canonical mode, a TP=2 model loads it back.

Six ranks of one engine -- four of a TP=4 model, two of a TP=2 model -- open one shared region (one file, the
replicated geometry: the canonical rows do not depend on the TP size), each with its own simulated device. The
model has 2 KV heads, so under TP=4 each head is held by two ranks and each canonical page is written once per
head, by rotating writers; the TP=2 ranks then load the pages and must hold exactly their heads.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.canonical_derive import LayerGeometry, ParallelContext, derive_layer
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.shared_region import SharedRegion
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import create_worker

__all__ = ["canonical_act"]

HEADS, BLOCK, HEAD_SIZE, ELEMENT = 2, 16, 64, 2  # 2 KV heads, 16-token blocks, head size 64, bf16
BLOCKS, BPC, CHUNKS, GPU_BLOCKS = 8, 2, 8, 16


def _geometry(tp: int) -> LayerGeometry:
    return LayerGeometry("split", block_size=BLOCK, element_size=ELEMENT, head_size=HEAD_SIZE, total_kv_heads=HEADS,
                         local_kv_heads=max(1, HEADS // tp))


def _heads(full: npt.NDArray[np.uint8], tp: int, rank: int) -> npt.NDArray[np.uint8]:
    """What TP rank ``rank`` holds of each block: its head (split NHD)."""
    head = rank // (tp // HEADS) if tp > HEADS else rank
    return np.ascontiguousarray(full[:, :, :, head:head + 1, :]).reshape(BLOCKS, -1)


def canonical_act(check: Callable[[bool, str], None], act: int,
                  device: Callable[[str], SimBackend] = lambda _name: SimBackend()) -> None:
    """Run the act, reporting each check through ``check(ok, what)``.

    Args:
        check: records one check (the demo's).
        act: the act's number, for its heading.
        device: makes each rank's simulated device, given the rank's name (e.g. "TP=4 rank 0"): the demo's traces
            every act's devices.
    """
    print(f"\nAct {act} -- the canonical layout (R24): a TP=4 model with {HEADS} KV heads stores {BLOCKS} blocks of "
          "one layer in canonical mode into a shared region; a TP=2 model then loads them back from the same bytes. "
          "Each canonical page is written once per head, by one of the two ranks holding that head. No errors are "
          "expected.")
    maps = {tp: derive_layer("layer", ParallelContext(tp=tp), _geometry(tp)) for tp in (4, 2)}
    slots = [(4, r) for r in range(4)] + [(2, r) for r in range(2)]
    full = np.random.default_rng(24).integers(1, 256, (BLOCKS, 2, BLOCK, HEADS, HEAD_SIZE * ELEMENT), dtype=np.uint8)
    gpu_spec = GPULoadStoreSpec(np.arange(BLOCKS, dtype=np.int64), group_sizes=(BLOCKS,), block_indices=(0,))
    cpu_spec = CPULoadStoreSpec(np.arange(BLOCKS // BPC, dtype=np.int64) + 2)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=directory) as where:
        backends = [device(f"TP={tp} rank {rank}") for tp, rank in slots]
        page = maps[4][0].local_page_size
        cpu_layout = CanonicalLayout([maps[4][0]]).cpu_layout(KVCacheLayout([page], [[LayerRef(0, page)]]))
        regions = [SharedRegion.open("demo-canonical", backend=be, layout=cpu_layout, blocks_per_chunk=BPC,
                                     num_cpu_chunks=CHUNKS, rank=i, world_size=len(slots), replicated=True,
                                     directory=where) for i, be in enumerate(backends)]
        copied, exact, clean = [], True, True
        for i, (tp, rank) in enumerate(slots):
            mapping, be = maps[tp][rank], backends[i]
            local = _heads(full, tp, rank)
            rows = np.zeros((GPU_BLOCKS, mapping.local_page_size), dtype=np.uint8)
            if tp == 4:
                rows[:BLOCKS] = local
            gpu = be.from_host(rows)
            layout = KVCacheLayout([mapping.local_page_size], [[LayerRef(0, mapping.local_page_size)]])
            with create_worker(be, [gpu], layout, blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS, region=regions[i],
                               canonical=CanonicalLayout([mapping], rank=rank)) as w:
                if tp == 4:
                    w.submit_store(1, gpu_spec, cpu_spec)
                else:
                    w.submit_load(1, cpu_spec, gpu_spec)
                w.wait([1])
                (result,) = w.get_finished()
                copied.append(result.transfer_size or 0)
                exact &= result.success and (tp == 4 or bool(np.array_equal(be.to_host(gpu)[:BLOCKS], local)))
            clean &= not be.violations
    print("  bytes copied per rank: TP=4 stores " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(copied[:4]))
          + "; TP=2 loads " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(copied[4:])))
    check(sum(copied[:4]) == full.nbytes, f"the TP=4 stores copied each canonical byte once ({sum(copied[:4])} "
          f"bytes = the unsharded {full.nbytes})")
    check(exact, "every TP=2 rank's GPU bytes equal its heads of the unsharded KV, byte for byte")
    check(clean, "no violation on any rank's device")
