"""The placement rule in plain Python: which byte of which GPU row goes to which byte of which CPU row (R7).

This is the one plain statement of the rule (reference §2.3/§2.4). :func:`plan_moves` lists the byte moves of one
valid transfer; :func:`check_transfer` validates a transfer (every refusal of R7 that concerns the specs) and
returns its moves; :meth:`Move.addresses` turns a move into a ``(src, dst, size)`` copy on a geometry. The
reference worker (``kvoffload_ref.reference``) builds its descriptors from it, the conformance model predicts
memory with it, and the vectorized :class:`~kvoffload_ref.planner.Planner` is differential-tested against it
(tests/test_placement.py). No numpy loops, no caching: one loop per group, ref and block.

In canonical mode (R24) :func:`canonical_moves` expands each block's move into one move per fragment of its
tensor's mapping (the CPU sub-block being the canonical page), dropping a store's blocks whose CPU canonical page
this rank does not write; :func:`check_transfer` does it when given the mappings.

Pure: imports only ``kvoffload_ref.specs``, ``kvoffload_ref.canonical_plan`` and ``kvoffload_ref.errors``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, TensorGeometry

__all__ = ["Move", "canonical_moves", "check_transfer", "plan_moves"]


@dataclasses.dataclass(frozen=True)
class Move:
    """``size`` bytes of tensor ``tensor``: GPU row ``gpu_row`` bytes [gpu_col, gpu_col + size) <-> CPU row
    ``cpu_row`` bytes [cpu_col, cpu_col + size)."""

    tensor: int
    gpu_row: int
    cpu_row: int
    cpu_col: int
    size: int
    gpu_col: int = 0  # Invariant: 0 but in canonical mode, where it is a fragment's offset in the GPU page.

    def at(self, side: str) -> tuple[int, int, int]:
        """(row, first byte, end byte) of this move on ``side`` ("gpu" or "cpu")."""
        if side == "gpu":
            return self.gpu_row, self.gpu_col, self.gpu_col + self.size
        return self.cpu_row, self.cpu_col, self.cpu_col + self.size

    def addresses(self, direction: Direction, gpu: Sequence[TensorGeometry],
                  cpu: Sequence[TensorGeometry]) -> tuple[int, int, int]:
        """The move as one copy descriptor ``(src address, dst address, size)`` on this geometry."""
        g, c = gpu[self.tensor], cpu[self.tensor]
        gpu_addr = g.ptr + self.gpu_row * g.row_stride + self.gpu_col
        cpu_addr = c.ptr + self.cpu_row * c.row_stride + self.cpu_col
        return (gpu_addr, cpu_addr, self.size) if direction == "store" else (cpu_addr, gpu_addr, self.size)


def plan_moves(layout: KVCacheLayout, blocks_per_chunk: int, gpu_spec: GPULoadStoreSpec,
               cpu_spec: CPULoadStoreSpec) -> list[Move]:
    """The byte moves of one valid transfer, by the naive rule (one loop per group, ref and block).

    Group ``g`` of size ``n`` and block index ``i`` takes the next ``n`` GPU ids and the next
    ``ceil((n + i) / blocks_per_chunk)`` CPU ids; its ``k``-th block sits at sub-block position ``i + k`` of
    those chunks. Empty groups use no ids. Moves come group-major, then ref, then block.
    """
    gpu_ids, cpu_ids = gpu_spec.block_ids.tolist(), cpu_spec.block_ids.tolist()
    moves: list[Move] = []
    gpu_off = cpu_off = 0
    for g, refs in enumerate(layout.groups):
        n, skip = gpu_spec.group_sizes[g], gpu_spec.block_indices[g]
        if n == 0:
            continue
        for ref in refs:
            page = layout.tensor_page_bytes[ref.tensor_idx]
            for k in range(n):
                pos = skip + k
                moves.append(Move(ref.tensor_idx, gpu_ids[gpu_off + k], cpu_ids[cpu_off + pos // blocks_per_chunk],
                                  (pos % blocks_per_chunk) * page, ref.page_size_bytes))
        gpu_off += n
        cpu_off += -(-(n + skip) // blocks_per_chunk)
    return moves


def canonical_moves(layout: KVCacheLayout, direction: str, moves: list[Move], canonical: CanonicalLayout,
                    blocks_per_chunk: int) -> list[Move]:
    """R24, plainly: each block's move (of :func:`plan_moves`) as one move per fragment of its tensor's mapping.

    The block at sub-block ``j`` of CPU chunk ``c`` is canonical page ``c * blocks_per_chunk + j``, at byte
    ``j * canonical_page`` of the row; a store drops it unless this rank writes that page (``is_writer``); a load
    keeps every block. Moves come in the order of ``moves``, then fragment.
    """
    out: list[Move] = []
    for m in moves:
        mapping = canonical.mappings[m.tensor]
        sub = m.cpu_col // layout.tensor_page_bytes[m.tensor]
        if direction == "store" and not mapping.is_writer(m.cpu_row * blocks_per_chunk + sub):
            continue  # another rank stores this canonical page
        base = sub * mapping.canonical_page_size
        for run in mapping.runs:
            for i in range(run.num_fragments):
                out.append(Move(m.tensor, m.gpu_row, m.cpu_row, base + run.canonical_offset + i * run.canonical_stride,
                                run.fragment_size, run.local_offset + i * run.local_stride))
    return out


def check_transfer(layout: KVCacheLayout, direction: str, src_spec: object, dst_spec: object,
                   gpu_rows: Sequence[int], cpu_rows: Sequence[int], blocks_per_chunk: int,
                   canonical: CanonicalLayout | None = None) -> list[Move]:
    """Validate one transfer against the layout (R7) and return its moves.

    Args:
        layout: the KV-cache layout.
        direction: "store" (src a GPULoadStoreSpec, dst a CPULoadStoreSpec) or "load" (the other way round).
        src_spec, dst_spec: the caller's specs (anything: their types are checked here).
        gpu_rows, cpu_rows: rows of each GPU tensor and of each CPU view.
        blocks_per_chunk: GPU pages per CPU row.
        canonical: this rank's canonical mappings (R24), or None (plain mode).

    Returns:
        :func:`plan_moves` of the transfer (in canonical mode, :func:`canonical_moves` of them).

    Raises:
        InvalidTransferError: an unknown direction, a spec of the wrong type, a group count other than the
            layout's, a non-empty group's block index >= blocks_per_chunk, a CPU id count other than the groups
            need, an id out of range of a tensor it indexes, or a destination written twice (a (tensor, GPU
            block) of a load, a (tensor, CPU chunk, sub-block) of a store; a repeated source is fine).
    """
    if direction not in ("store", "load"):
        raise InvalidTransferError(f"direction must be 'store' or 'load', got {direction!r}")
    src_cls, dst_cls = ((GPULoadStoreSpec, CPULoadStoreSpec) if direction == "store"
                        else (CPULoadStoreSpec, GPULoadStoreSpec))
    for arg, spec, cls in (("src_spec", src_spec, src_cls), ("dst_spec", dst_spec, dst_cls)):
        if not isinstance(spec, cls):
            raise InvalidTransferError(f"{direction}: {arg} must be a {cls.__name__}, got {type(spec).__name__}")
    gpu_spec, cpu_spec = (src_spec, dst_spec) if direction == "store" else (dst_spec, src_spec)
    assert isinstance(gpu_spec, GPULoadStoreSpec) and isinstance(cpu_spec, CPULoadStoreSpec)  # checked above
    sizes, indices, bpc = gpu_spec.group_sizes, gpu_spec.block_indices, blocks_per_chunk
    if len(sizes) != layout.num_groups:
        raise InvalidTransferError(f"GPULoadStoreSpec has {len(sizes)} group sizes, expected {layout.num_groups} "
                                   "(one per KV-cache group of the layout)")
    needed = 0
    for g, (n, index) in enumerate(zip(sizes, indices, strict=True)):
        if n and index >= bpc:
            raise InvalidTransferError(f"block_indices[{g}] = {index} is out of range: expected "
                                       f"0 <= block index < blocks_per_chunk = {bpc}")
        needed += -(-(n + index) // bpc) if n else 0
    if needed != len(cpu_spec.block_ids):
        raise InvalidTransferError(f"CPULoadStoreSpec has {len(cpu_spec.block_ids)} block ids, expected {needed} "
                                   f"(group_sizes={sizes}, block_indices={indices}, blocks_per_chunk={bpc})")
    moves = plan_moves(layout, bpc, gpu_spec, cpu_spec)
    seen: set[tuple[int, ...]] = set()
    for m in moves:
        for side, row, rows in (("GPU", m.gpu_row, gpu_rows[m.tensor]), ("CPU", m.cpu_row, cpu_rows[m.tensor])):
            if row >= rows:
                raise InvalidTransferError(f"{side} block id {row} is out of range for tensor {m.tensor}: "
                                           f"expected 0 <= id < {rows}")
        page = layout.tensor_page_bytes[m.tensor]
        key = (m.tensor, m.gpu_row) if direction == "load" else (m.tensor, m.cpu_row, m.cpu_col // page)
        if key in seen:
            where = (f"GPU block {m.gpu_row}" if direction == "load" else
                     f"CPU chunk {m.cpu_row} sub-block {m.cpu_col // page}")
            raise InvalidTransferError(f"{direction}: {where} of tensor {m.tensor} is a destination twice: "
                                       "expected each destination written once per transfer (a repeated source "
                                       "is fine)")
        seen.add(key)
    return moves if canonical is None else canonical_moves(layout, direction, moves, canonical, bpc)
