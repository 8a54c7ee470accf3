"""Each destination of a transfer is written once: the planner's duplicate-destination check (pure numpy, R7).

A transfer's copies must not write one destination twice: the bytes left there would depend on the order the
device runs the copies in. A destination is a *(tensor, GPU block id)* pair for a load and a *(tensor, CPU chunk
id, sub-block)* triple for a store, for every tensor a group's refs name (each tensor once per group: two refs of
one group naming one tensor copy the same source bytes to the same place). Sources may repeat.

The check has two steps, so that the common case costs one scatter:

1. :class:`RepeatTest` asks whether any id of the destination side repeats at all. Distinct ids mean distinct
   destinations (a GPU id is one row of each tensor; a CPU chunk id is ``blocks_per_chunk`` sub-blocks of each
   tensor), so a transfer with distinct ids passes here. Short id lists use a Python set; longer ones scatter
   their positions into a scratch array indexed by id (``scratch[ids] = positions``) and read them back: an id
   that repeats reads back another position, whichever write landed last.
2. Only when an id repeats, :func:`gpu_duplicate` / :func:`cpu_duplicate` build the exact keys (tensor and
   position) and sort them: a repeat may still be legal (two groups over different tensors naming one block id,
   or one chunk whose sub-blocks two groups share).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["GroupSpan", "RepeatTest", "cpu_duplicate", "gpu_duplicate"]

Int64Array = npt.NDArray[np.int64]

#: Up to this many ids a Python set beats the scatter (measured: about 1 us for 32 ids).
SMALL: Final = 64


class RepeatTest:
    """Whether a list of ids, each ``< rows``, holds a repeat; one per planner side, safe across threads.

    Args:
        rows: an upper bound (exclusive) on the ids tested (the side's largest tensor row count).
    """

    def __init__(self, rows: int) -> None:
        self._rows = rows
        # Invariant: None until the first long list; then int32 of length _rows. Its contents between calls mean
        # nothing: a call writes every entry it reads. Used under _lock only.
        self._scratch: npt.NDArray[np.int32] | None = None
        # Invariant: arange(len) (grown on demand); used under _lock only.
        self._positions: npt.NDArray[np.int32] = np.arange(0, dtype=np.int32)
        self._lock = threading.Lock()

    def any_repeat(self, ids: Int64Array) -> bool:
        """Whether some id occurs twice in ``ids`` (1-D int64, every id in ``[0, rows)``)."""
        n = ids.size
        if n < 2:
            return False
        if n <= SMALL or n >= 2**31:
            return len(set(ids.tolist())) != n
        with self._lock:
            if self._scratch is None:
                self._scratch = np.empty(self._rows, dtype=np.int32)  # untouched pages cost nothing
            if self._positions.size < n:
                self._positions = np.arange(max(n, 2 * self._positions.size), dtype=np.int32)
            positions = self._positions[:n]
            self._scratch[ids] = positions
            return not np.array_equal(np.take(self._scratch, ids), positions)


@dataclasses.dataclass(frozen=True)
class GroupSpan:
    """The ids one non-empty group consumes on the destination side, and the tensors it writes.

    Attributes:
        tensors: the distinct tensors the group's refs name.
        offset: position of the group's first id in the spec's block ids.
        skip: sub-blocks skipped in the first chunk (CPU side; 0 on the GPU side).
        size: blocks the group moves.
    """

    tensors: Int64Array
    offset: int
    skip: int
    size: int


def gpu_duplicate(spans: Sequence[GroupSpan], ids: Int64Array) -> tuple[int, int, int, int] | None:
    """The first GPU destination written twice, as ``(tensor, block id, position, later position)`` (positions
    index the spec's block ids); None if every destination is written once."""
    parts = []
    for span in spans:
        positions = np.arange(span.offset, span.offset + span.size, dtype=np.int64)
        for tensor in span.tensors.tolist():
            parts.append(np.stack([np.full(span.size, tensor, dtype=np.int64), ids[positions], positions]))
    found = _equal_keys(np.concatenate(parts, axis=1))
    return None if found is None else (found[0][0], found[0][1], found[1], found[2])


def cpu_duplicate(spans: Sequence[GroupSpan], ids: Int64Array,
                  blocks_per_chunk: int) -> tuple[int, int, int, int, int] | None:
    """The first CPU destination written twice, as ``(tensor, chunk id, sub-block, position, later position)``
    (positions index the spec's chunk ids); None if every destination is written once."""
    parts = []
    for span in spans:
        k = np.arange(span.skip, span.skip + span.size, dtype=np.int64)  # sub-block positions in the chunks
        positions = span.offset + k // blocks_per_chunk
        for tensor in span.tensors.tolist():
            parts.append(np.stack([np.full(span.size, tensor, dtype=np.int64), ids[positions],
                                   k % blocks_per_chunk, positions]))
    found = _equal_keys(np.concatenate(parts, axis=1))
    return None if found is None else (found[0][0], found[0][1], found[0][2], found[1], found[2])


def _equal_keys(keys: Int64Array) -> tuple[list[int], int, int] | None:
    """The first two columns of ``keys`` (in key order) equal in every row but the last, as (their key, the
    smaller and the larger of their last rows); None if all keys differ. The last row is each column's position."""
    order = np.lexsort(keys[::-1])
    ordered = keys[:, order]
    same = np.all(ordered[:-1, 1:] == ordered[:-1, :-1], axis=0)
    if not same.any():
        return None
    i = int(np.flatnonzero(same)[0])
    return [int(v) for v in ordered[:-1, i]], int(ordered[-1, i]), int(ordered[-1, i + 1])
