"""The canonical (sharding-free) layout's mapping model and its verification (R24), pure (numpy and stdlib).

Theory of operation
-------------------
In canonical mode (vLLM's ``canonical_layout``, PRs #48408, #48414, #51688) the CPU copy of a block of one layer
is not this rank's GPU page but the *canonical page*: the page the layer would have if the model were not
sharded at all -- every KV head, every token of the offloaded block (``block_size * dcp * pcp`` of them) -- in the
worker's page encoding. A cache stored under one parallel configuration then loads under another, and bytes
that several ranks hold (replicated KV heads, the MLA latent) are stored once.

Which bytes of this rank's page go where in the canonical page is a :class:`PageMapping`: a list of
:class:`ByteRun`, each a strided train of equal fragments (fragment ``i`` is ``[local_offset + i*local_stride,
+fragment_size)`` on this rank's page and ``[canonical_offset + i*canonical_stride, +fragment_size)`` on the
canonical page). Ranks that hold the same bytes share the store work by rotation: a rank stores canonical page
``p`` only when ``p % num_writers == writer_index`` (:meth:`PageMapping.is_writer`); loads are never filtered.

R24 asks two things of the mappings of one layer across the ranks of the group, checked before any device
work (:func:`verify_mappings`): each rank's runs cover its own page exactly once and write no canonical byte
twice (:func:`verify_mapping`, what a worker checks of its own rank), and, for each writer index, the runs of the
ranks that write it tile the canonical page exactly once. A failure is a :class:`MappingError` naming the layer,
the rank and the first byte where a gap or an overlap begins (for canonical bytes one rank writes twice, their
range).

How the mappings are derived from a parallel context and a layer's geometry is
:mod:`kvoffload_ref.canonical_derive`'s business; this module knows nothing of parallelism.

Pure: imports only ``kvoffload_ref.errors`` and ``kvoffload_ref.validate``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Final, Literal

import numpy as np

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.validate import INT64_MAX, Int64Array, check_int, readonly

__all__ = [
    "CANONICAL_FORMAT_VERSION",
    "KVOrder",
    "ByteRun",
    "PageMapping",
    "MappingError",
    "canonical_format_id",
    "verify_mapping",
    "verify_mappings",
]

#: Version of the canonical byte format; a change of the layout the derivation produces bumps it (vLLM #48414).
CANONICAL_FORMAT_VERSION: Final = 1

#: The worker's KV layout family: token-major (``NHD``) or head-major (``HND``) pages.
KVOrder = Literal["NHD", "HND"]

#: What went wrong where, in a :class:`MappingError`.
Problem = Literal["gap", "overlap", "mismatch"]


def canonical_format_id(order: str) -> str:
    """The identity of the canonical byte format, for namespacing persisted canonical bytes (vLLM #48414).

    A canonical page keeps the worker's layout family, so the id couples :data:`CANONICAL_FORMAT_VERSION` with
    it: ``"v1-nhd"`` or ``"v1-hnd"``. Bytes stored under one id must only be read under the same id.

    Args:
        order: ``"NHD"`` or ``"HND"``.

    Returns:
        ``f"v{CANONICAL_FORMAT_VERSION}-{order.lower()}"``.

    Raises:
        InvalidTransferError: ``order`` is neither ``"NHD"`` nor ``"HND"``.
    """
    if order not in ("NHD", "HND"):
        raise InvalidTransferError(f"order must be 'NHD' or 'HND', got {order!r}")
    return f"v{CANONICAL_FORMAT_VERSION}-{order.lower()}"


@dataclasses.dataclass(frozen=True)
class ByteRun:
    """A strided train of ``num_fragments`` equal fragments between this rank's page and the canonical page.

    Fragment ``i`` is bytes ``[local_offset + i*local_stride, +fragment_size)`` of this rank's (unpadded) page
    and bytes ``[canonical_offset + i*canonical_stride, +fragment_size)`` of the canonical page. A store copies
    local -> canonical, a load canonical -> local.

    Raises:
        InvalidTransferError: a field is not an int, an offset or stride is negative, or ``fragment_size`` or
            ``num_fragments`` is below 1.
    """

    local_offset: int  # Invariant: >= 0.
    canonical_offset: int  # Invariant: >= 0.
    fragment_size: int  # Invariant: >= 1.
    num_fragments: int  # Invariant: >= 1.
    local_stride: int  # Invariant: >= 0 (a stride below fragment_size overlaps itself; verification says where).
    canonical_stride: int  # Invariant: >= 0.

    def __post_init__(self) -> None:
        values = (self.local_offset, self.canonical_offset, self.fragment_size, self.num_fragments,
                  self.local_stride, self.canonical_stride)
        if (all(type(v) is int and 0 <= v <= INT64_MAX for v in values)
                and self.fragment_size >= 1 and self.num_fragments >= 1):
            return  # the common case, checked without building messages
        for name, minimum in (("local_offset", 0), ("canonical_offset", 0), ("fragment_size", 1),
                              ("num_fragments", 1), ("local_stride", 0), ("canonical_stride", 0)):
            value = check_int(f"ByteRun.{name}", getattr(self, name), minimum=minimum, maximum=INT64_MAX)
            object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        """Bytes the run copies: ``fragment_size * num_fragments``."""
        return self.fragment_size * self.num_fragments

    def local_end(self) -> int:
        """One past the last local byte the run touches."""
        return self.local_offset + (self.num_fragments - 1) * self.local_stride + self.fragment_size

    def canonical_end(self) -> int:
        """One past the last canonical byte the run touches."""
        return self.canonical_offset + (self.num_fragments - 1) * self.canonical_stride + self.fragment_size


@dataclasses.dataclass(frozen=True)
class PageMapping:
    """One rank's mapping of one layer: its page's byte runs into the canonical page, and its store duty.

    Attributes:
        canonical_page_size: bytes of the canonical page (the CPU sub-block of this layer's tensor).
        local_page_size: bytes of this rank's page, unpadded (the bytes the runs cover).
        runs: the byte runs, in copy order (a list is accepted).
        num_writers: how many ranks share the store work of each canonical byte (by rotation).
        writer_index: this rank's turn: it stores canonical page ``p`` when ``p % num_writers == writer_index``.
        parallelism_agnostic: the canonical bytes do not depend on the parallel configuration (no context
            parallelism, not opaque): a cache stored under one TP size loads under another.
        format_id: the canonical byte format (:func:`canonical_format_id`).
        opaque: the derivation could not certify the layout and placed the page whole at a rank-exclusive
            offset (the fallback); such bytes only load under the same parallel configuration.
        fallback_reason: why the derivation fell back (empty when certified).

    Raises:
        InvalidTransferError: a size or count is not an int >= 1, ``writer_index`` is not in ``[0,
            num_writers)``, ``runs`` is not a sequence of :class:`ByteRun`, a run reaches past either page, the
            runs have more fragments than the local page has bytes (so some must overlap), or a flag or
            string has the wrong type.
    """

    canonical_page_size: int  # Invariant: >= 1.
    local_page_size: int  # Invariant: >= 1.
    runs: tuple[ByteRun, ...]  # Invariant: every run lies inside both pages; fragments in all <= local_page_size.
    num_writers: int = 1  # Invariant: >= 1.
    writer_index: int = 0  # Invariant: 0 <= writer_index < num_writers.
    parallelism_agnostic: bool = True  # Invariant: False when opaque.
    format_id: str = canonical_format_id("NHD")  # Invariant: what canonical_format_id returns for some order.
    opaque: bool = False  # Invariant: True exactly for the derivation's fallback.
    fallback_reason: str = ""  # Invariant: empty unless opaque.

    def __post_init__(self) -> None:
        for name in ("canonical_page_size", "local_page_size", "num_writers"):
            object.__setattr__(self, name, check_int(f"PageMapping.{name}", getattr(self, name), minimum=1,
                                                     maximum=INT64_MAX))
        object.__setattr__(self, "writer_index", check_int("PageMapping.writer_index", self.writer_index,
                                                           minimum=0, maximum=self.num_writers - 1))
        for name in ("parallelism_agnostic", "opaque"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidTransferError(f"PageMapping.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("format_id", "fallback_reason"):
            if not isinstance(getattr(self, name), str):
                raise InvalidTransferError(f"PageMapping.{name} must be a str, got {getattr(self, name)!r}")
        if self.opaque and self.parallelism_agnostic:
            raise InvalidTransferError("PageMapping: an opaque mapping cannot be parallelism_agnostic")
        if self.fallback_reason and not self.opaque:
            raise InvalidTransferError("PageMapping: only an opaque mapping has a fallback_reason")
        object.__setattr__(self, "runs", self._checked_runs())

    def _checked_runs(self) -> tuple[ByteRun, ...]:
        """``runs`` as a tuple, each a ByteRun inside both pages, with no more fragments than local bytes."""
        if isinstance(self.runs, (str, bytes)) or not isinstance(self.runs, Sequence):
            raise InvalidTransferError(f"PageMapping.runs must be a sequence of ByteRun, got "
                                       f"{type(self.runs).__name__}")
        runs = tuple(self.runs)
        fragments = 0
        for i, run in enumerate(runs):
            if not isinstance(run, ByteRun):
                raise InvalidTransferError(f"PageMapping.runs[{i}] must be a ByteRun, got {type(run).__name__}")
            if run.local_end() > self.local_page_size:
                raise InvalidTransferError(f"PageMapping.runs[{i}] reaches local byte {run.local_end()}, past the "
                                           f"local page of {self.local_page_size} bytes")
            if run.canonical_end() > self.canonical_page_size:
                raise InvalidTransferError(f"PageMapping.runs[{i}] reaches canonical byte {run.canonical_end()}, "
                                           f"past the canonical page of {self.canonical_page_size} bytes")
            fragments += run.num_fragments
        if fragments > self.local_page_size:
            raise InvalidTransferError(f"PageMapping.runs have {fragments} fragments for a local page of "
                                       f"{self.local_page_size} bytes: some must overlap")
        return runs

    def is_writer(self, page_id: int) -> bool:
        """Whether this rank stores canonical page ``page_id`` (rotating writers, so replicas share the work).

        Args:
            page_id: the CPU canonical page id (chunk id times blocks per chunk, plus the sub-block), >= 0.

        Returns:
            ``page_id % num_writers == writer_index``.

        Raises:
            InvalidTransferError: ``page_id`` is not an int >= 0.
        """
        return check_int("page_id", page_id, minimum=0) % self.num_writers == self.writer_index

    @property
    def copied_bytes(self) -> int:
        """Bytes one block's copy moves (either direction): the sum of the runs' fragments."""
        return sum(run.nbytes for run in self.runs)

    @property
    def num_fragments(self) -> int:
        """Fragments (copy descriptors) per block, after the derivation's coalescing."""
        return sum(run.num_fragments for run in self.runs)

    @functools.cached_property
    def _unrolled(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """:meth:`fragments`, computed once (a cache, not a field: outside eq, hash and repr)."""
        table = np.array([[r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments, r.local_stride,
                           r.canonical_stride] for r in self.runs], dtype=np.int64).reshape(-1, 6)
        counts = table[:, 3]
        first = np.cumsum(counts) - counts
        index = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
        local = np.repeat(table[:, 0], counts) + index * np.repeat(table[:, 4], counts)
        canonical = np.repeat(table[:, 1], counts) + index * np.repeat(table[:, 5], counts)
        return readonly(local), readonly(canonical), readonly(np.repeat(table[:, 2], counts))

    def fragments(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The runs unrolled, run after run: (local offsets, canonical offsets, sizes), read-only int64 arrays.

        A store's plan for one block copies ``local[i] -> canonical[i]`` for ``sizes[i]`` bytes; a load the
        reverse.

        Returns:
            Three arrays of :attr:`num_fragments` entries each (computed once per mapping).
        """
        return self._unrolled


class MappingError(InvalidTransferError):
    """A layer's mappings break R24: a gap or an overlap in a page, or ranks that disagree on the page.

    Attributes:
        layer: the layer's name.
        rank: the rank the failure is pinned on (None when no rank writes the page at all).
        problem: ``"gap"``, ``"overlap"`` or ``"mismatch"``.
        page: ``"local"`` (a rank's own page) or ``"canonical"``.
        offset: the byte where the problem starts (for a mismatch, 0).
        writer_index: on the canonical page, the writer index whose writers fail to tile it; else None.
    """

    def __init__(self, message: str, *, layer: str, rank: int | None, problem: Problem,
                 page: Literal["local", "canonical"], offset: int, writer_index: int | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.rank = rank
        self.problem: Problem = problem
        self.page = page
        self.offset = offset
        self.writer_index = writer_index

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_mapping_error, (str(self), self.layer, self.rank, self.problem, self.page, self.offset,
                                         self.writer_index))


def _rebuild_mapping_error(message: str, layer: str, rank: int | None, problem: Problem,
                           page: Literal["local", "canonical"], offset: int,
                           writer_index: int | None) -> MappingError:
    return MappingError(message, layer=layer, rank=rank, problem=problem, page=page, offset=offset,
                        writer_index=writer_index)


@dataclasses.dataclass(frozen=True)
class _Fault:
    """The first place where sorted fragments fail to tile ``[0, size)`` once."""

    problem: Problem
    offset: int  # Invariant: the first byte of the gap or of the overlap.
    length: int  # Invariant: for a gap, the bytes uncovered; for an overlap, 0.
    index: int  # Invariant: the sorted fragment the fault is pinned on (-1 when there is none).
    other: int  # Invariant: for an overlap, the earlier fragment it overlaps; else -1.


def _first_fault(starts: Int64Array, sizes: Int64Array, size: int) -> tuple[_Fault | None, Int64Array]:
    """Sort fragments by start and find where they first fail to tile ``[0, size)`` exactly once.

    Returns:
        The fault (None when they tile) and the sort order (indices into ``starts``).
    """
    order = np.lexsort((sizes, starts))
    s, e = starts[order], starts[order] + sizes[order]
    if not len(s):
        return _Fault("gap", 0, size, -1, -1), order
    reach = np.maximum.accumulate(e)  # reach[i]: one past the furthest byte fragments 0..i cover
    before = np.concatenate([np.zeros(1, dtype=np.int64), reach[:-1]])
    bad = np.flatnonzero(s != before)
    if len(bad):
        i = int(bad[0])
        if s[i] > before[i]:
            return _Fault("gap", int(before[i]), int(s[i] - before[i]), i, -1), order
        other = int(np.flatnonzero(e[:i] > s[i])[0])  # the first earlier fragment still covering s[i]
        return _Fault("overlap", int(s[i]), 0, i, other), order
    end = int(reach[-1])  # <= size: a PageMapping's runs lie inside its pages
    if end < size:
        return _Fault("gap", end, size - end, int(np.argmax(e)), -1), order
    return None, order


def _first_overlap(starts: Int64Array, sizes: Int64Array) -> tuple[int, int, int, int] | None:
    """Where fragments first overlap one another (gaps are allowed: a rank writes only part of the canonical page).

    Returns:
        None when no byte is covered twice; else ``(first, end, later, earlier)``: the overlapping bytes
        ``[first, end)`` of the two fragments that overlap first in start order, as indices into ``starts``.
    """
    if len(starts) < 2:
        return None
    order = np.lexsort((sizes, starts))
    s, e = starts[order], starts[order] + sizes[order]
    reach = np.maximum.accumulate(e)
    bad = np.flatnonzero(s[1:] < reach[:-1])
    if not len(bad):
        return None
    i = int(bad[0]) + 1
    other = int(np.flatnonzero(e[:i] > s[i])[0])  # the first earlier fragment still covering s[i]
    return int(s[i]), int(min(e[i], e[other])), int(order[i]), int(order[other])


def _check_name(layer: object) -> str:
    if not isinstance(layer, str):
        raise InvalidTransferError(f"layer must be a str (the layer's name), got {type(layer).__name__}")
    return layer


def _check_mapping(mapping: object, where: str) -> PageMapping:
    if not isinstance(mapping, PageMapping):
        raise InvalidTransferError(f"{where} must be a PageMapping, got {type(mapping).__name__}")
    return mapping


def verify_mapping(layer: str, rank: int, mapping: PageMapping) -> None:
    """R24, one rank: the runs cover the rank's local page exactly once (no gap, no overlap, nothing past it), and
    write no canonical byte twice (two local bytes copied to one canonical byte would leave another canonical byte
    unwritten by this rank, while a store still reports success).

    Args:
        layer: the layer's name (for the message).
        rank: the rank that owns ``mapping`` (for the message), >= 0.
        mapping: the rank's mapping of the layer.

    Raises:
        MappingError: the runs leave a gap or overlap in the local page (the message names the layer, the rank and
            the first byte), or two of its fragments write the same canonical bytes (``page="canonical"``; the
            message names the layer, the rank, the runs and the overlapping canonical byte range).
        InvalidTransferError: ``layer`` is not a str, ``rank`` not an int >= 0, ``mapping`` not a PageMapping.
    """
    layer = _check_name(layer)
    rank = check_int("rank", rank, minimum=0)
    mapping = _check_mapping(mapping, "mapping")
    local, canonical, sizes = mapping.fragments()
    fault, order = _first_fault(local, sizes, mapping.local_page_size)
    where = f"layer {layer!r}, rank {rank}: the runs"
    if fault is not None:
        if fault.problem == "gap":
            text = f"{where} leave a gap in the local page at byte {fault.offset} ({fault.length} bytes uncovered)"
        else:
            first, second = _run_of(mapping, order[fault.other]), _run_of(mapping, order[fault.index])
            text = (f"{where} overlap in the local page at byte {fault.offset}: runs[{first}] and runs[{second}] "
                    f"both cover it")
        raise MappingError(text, layer=layer, rank=rank, problem=fault.problem, page="local", offset=fault.offset)
    twice = _first_overlap(canonical, sizes)
    if twice is not None:  # R24: each canonical byte is written by one fragment of one rank at most
        lo, hi, later, earlier = twice
        first, second = _run_of(mapping, earlier), _run_of(mapping, later)
        text = (f"{where} write canonical bytes [{lo}, {hi}) twice: runs[{first}] and runs[{second}] both write "
                f"them (each canonical byte must come from one local byte)")
        raise MappingError(text, layer=layer, rank=rank, problem="overlap", page="canonical", offset=lo)


def _run_of(mapping: PageMapping, fragment: int) -> int:
    """The index of the run that unrolled fragment ``fragment`` belongs to."""
    counts = np.cumsum([r.num_fragments for r in mapping.runs])
    return int(np.searchsorted(counts, fragment, side="right"))


def verify_mappings(layer: str, mappings: Sequence[PageMapping]) -> None:
    """R24, the whole group: every rank's runs cover its local page once, and for each writer index ``b`` in
    ``[0, num_writers)`` the runs of the ranks whose writer index is ``b`` tile the canonical page exactly once.

    The worker calls this at construction, before any device work, with the mappings of every rank of the
    group (rank ``r`` at index ``r``).

    Args:
        layer: the layer's name (for the message).
        mappings: one mapping per rank, in rank order.

    Raises:
        MappingError: ranks disagree on the canonical page size, the writer count or the format id; a rank's
            runs do not cover its page once; or the writers of some index leave a gap or overlap in the
            canonical page. The message names the layer, the rank and the first byte of the problem.
        InvalidTransferError: ``mappings`` is empty or holds something that is not a PageMapping.
    """
    layer = _check_name(layer)
    if isinstance(mappings, (str, bytes)) or not isinstance(mappings, Sequence) or not mappings:
        raise InvalidTransferError("mappings must be a non-empty sequence of PageMapping, one per rank")
    group = [_check_mapping(m, f"mappings[{r}]") for r, m in enumerate(mappings)]
    first = group[0]
    for rank, mapping in enumerate(group):
        for field in ("canonical_page_size", "num_writers", "format_id"):
            if getattr(mapping, field) != getattr(first, field):
                raise MappingError(f"layer {layer!r}, rank {rank}: {field} = {getattr(mapping, field)!r} differs "
                                   f"from rank 0's {getattr(first, field)!r}", layer=layer, rank=rank,
                                   problem="mismatch", page="canonical", offset=0)
        verify_mapping(layer, rank, mapping)
    unrolled = [m.fragments() for m in group]
    for b in range(first.num_writers):
        writers = [r for r, m in enumerate(group) if m.writer_index == b]
        starts = np.concatenate([unrolled[r][1] for r in writers] or [np.zeros(0, dtype=np.int64)])
        sizes = np.concatenate([unrolled[r][2] for r in writers] or [np.zeros(0, dtype=np.int64)])
        owner = np.concatenate([np.full(len(unrolled[r][1]), r, dtype=np.int64) for r in writers]
                               or [np.zeros(0, dtype=np.int64)])
        fault, order = _first_fault(starts, sizes, first.canonical_page_size)
        if fault is None:
            continue
        culprit = int(owner[order[fault.index]]) if fault.index >= 0 else None
        where = (f"layer {layer!r}, rank {culprit}: writer index {b} (ranks {writers})" if culprit is not None
                 else f"layer {layer!r}: writer index {b}, which no rank holds,")
        if fault.problem == "gap":
            text = (f"{where} leaves a gap in the canonical page at byte {fault.offset} ({fault.length} bytes no "
                    f"writer stores)")
        else:
            text = (f"{where} overlaps in the canonical page at byte {fault.offset}: rank "
                    f"{int(owner[order[fault.other]])} already stores it")
        raise MappingError(text, layer=layer, rank=culprit, problem=fault.problem, page="canonical",
                           offset=fault.offset, writer_index=b)
