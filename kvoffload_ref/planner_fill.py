"""The planner's address arithmetic (pure numpy): a transfer's descriptor addresses written into caller arrays.

Each function writes one side of one KV-cache group's descriptors, refs x blocks, from per-ref columns the
:class:`~kvoffload_ref.planner.Planner` computed once for its geometry: GPU pages (``fill_gpu``), one block per ref
(``fill_one``: a small job's slice, flat), and CPU sub-blocks of chunks (``fill_cpu``, reference §2.3). Nothing here
validates: the planner checked every id first (R7).
"""

from __future__ import annotations

import numpy as np

from kvoffload_ref.specs import Int64Array

__all__ = ["add_outer", "fill_cpu", "fill_gpu", "fill_one"]


def fill_gpu(out: Int64Array, ptr: Int64Array, stride: Int64Array, ids: Int64Array) -> None:
    """Write ``ptr[r] + ids * stride[r]`` into ``out`` (shape: refs x blocks): one block per row."""
    np.multiply(stride, ids[None, :], out=out)
    out += ptr


def fill_one(out: Int64Array, first: Int64Array, stride: Int64Array | int, row: int) -> None:
    """Write ``first + row * stride`` into the 1-D ``out`` (one block or chunk ``row`` per ref): one addition where
    every ref has the same stride (an int: its product with ``row`` fits int64, as every validated address does)."""
    if type(stride) is int:
        np.add(first, row * stride, out=out)
        return
    np.multiply(stride, row, out=out)
    out += first


def add_outer(out: Int64Array, rows: Int64Array, subs: Int64Array) -> None:
    """``out[r, c, j] = rows[r, c] + subs[r, j]``, looping over the shorter of the two last axes.

    numpy runs its inner loop over the last axis; a short one (a few sub-blocks per chunk) makes that loop
    several times slower, so with fewer sub-blocks than chunks each sub-block position is one long strided add.
    """
    if subs.shape[1] <= rows.shape[1]:
        for j in range(subs.shape[1]):
            np.add(rows, subs[:, j:j + 1], out=out[:, :, j])
    else:
        np.add(rows[:, :, None], subs[:, None, :], out=out)


def fill_cpu(out: Int64Array, ptr: Int64Array, stride: Int64Array, subs: Int64Array, chunks: Int64Array, skip: int,
             bpc: int) -> None:
    """Write the group's CPU sub-block addresses into ``out`` (shape: refs x blocks).

    The sub-blocks of the chunks in order (``ptr[t] + chunk * stride[t] + j * sub[t]``), the first ``skip``
    dropped, the next ``out.shape[1]`` kept (reference §2.3): a partial first chunk (``head``), whole chunks
    written as a refs x chunks x bpc view of ``out``, and a partial last chunk (``tail``).
    """
    if bpc == 1:
        fill_gpu(out, ptr, stride, chunks)
        return
    rows = stride * chunks[None, :] + ptr  # refs x chunks
    size = out.shape[1]
    head = min(size, (bpc - skip) % bpc)
    first = 1 if skip else 0
    whole = (size - head) // bpc
    tail = size - head - whole * bpc
    if head:
        np.add(rows[:, :1], subs[:, skip:skip + head], out=out[:, :head])
    if whole:
        # Splitting the contiguous last axis never copies, so this reshape is a view that writes into ``out``.
        middle = out[:, head:head + whole * bpc].reshape(out.shape[0], whole, bpc)
        add_outer(middle, rows[:, first:first + whole], subs)
    if tail:
        np.add(rows[:, first + whole:first + whole + 1], subs[:, :tail], out=out[:, size - tail:])


