"""The KV-cache layout, the transfer specs and the geometry, and their validation (pure numpy).

Theory of operation
-------------------
A :class:`KVCacheLayout` lists the GPU tensors (``tensor_page_bytes[t]`` = row bytes of tensor ``t``, padding
included) and the KV-cache groups; each group is a list of :class:`LayerRef` (a tensor and the unpadded bytes
copied per block). On the GPU a tensor is ``(num_gpu_blocks, tensor_page_bytes[t])``: one block per row. On the
CPU it is ``(num_cpu_chunks, tensor_page_bytes[t] * blocks_per_chunk)``: a row (chunk) holds ``blocks_per_chunk``
GPU pages ("sub-blocks") of that tensor, sub-block ``j`` at byte ``j * tensor_page_bytes[t]``. A
:class:`TensorGeometry` gives one such tensor's address and strides; :func:`check_geometry` checks a whole side
against the layout.

A :class:`GPULoadStoreSpec` names GPU block ids (group after group, with each group's size and block index), a
:class:`CPULoadStoreSpec` names CPU chunk ids. Both are immutable and validated when built (R7): a 1-D list of
ints or an integer numpy array, no negative id, no bool (``[True, 5]`` is refused even though numpy would
silently make it ``[1, 5]``). What a pair of specs means -- which bytes move where -- is the planner's business
(``kvoffload_ref.planner``).

The input validators (:func:`check_int`, :func:`check_seconds`, :func:`check_positive`, :func:`check_timeout`,
:func:`check_job_ids`, :func:`check_id_array`) live in :mod:`kvoffload_ref.validate`, the package's one home for
checking user-supplied numbers and ids (R7); this module re-exports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Final, Literal, SupportsIndex

import numpy as np
import numpy.typing as npt

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.validate import (
    INT64_MAX,
    Int64Array,
    check_id_array,
    check_int,
    check_int_tuple,
    check_job_ids,
    check_positive,
    check_seconds,
    check_timeout,
    readonly,
)

__all__ = [
    "DIRECTIONS",
    "CPULoadStoreSpec",
    "Direction",
    "GPULoadStoreSpec",
    "Int64Array",
    "KVCacheLayout",
    "LayerRef",
    "TensorGeometry",
    "check_geometry",
    "check_id_array",
    "check_int",
    "check_job_ids",
    "check_positive",
    "check_seconds",
    "check_timeout",
]

#: ``"store"`` copies GPU -> CPU, ``"load"`` copies CPU -> GPU.
Direction = Literal["store", "load"]
DIRECTIONS: Final[tuple[Direction, Direction]] = ("store", "load")  # in the order shutdown drains them (R9)


@dataclasses.dataclass(frozen=True)
class TensorGeometry:
    """Geometry of one 2-D uint8 tensor (GPU array or CPU view), as the planner needs it.

    Attributes:
        ptr: address of row 0.
        rows: number of rows (GPU blocks, or CPU chunks).
        row_bytes: bytes per row (the page size, padding included).
        row_stride: bytes between the starts of consecutive rows (>= row_bytes).
    """

    ptr: int
    rows: int
    row_bytes: int
    row_stride: int


# ----------------------------------------------------------------------------------------------- validation


def _as_block_ids(block_ids: object, owner: str) -> Int64Array:
    """Validate a spec's ``block_ids`` (R7) and return them as a read-only 1-D int64 copy (see
    :func:`check_id_array`; the messages name ``<owner>.block_ids``)."""
    return check_id_array(f"{owner}.block_ids", block_ids, noun="block ids")


# ------------------------------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class LayerRef:
    """One layer (or group of layers) of a KV-cache group: which tensor, and how many bytes per block to copy.

    Attributes:
        tensor_idx: index into ``KVCacheLayout.tensor_page_bytes`` (and into the GPU/CPU tensor lists).
        page_size_bytes: bytes copied per block for this layer, unpadded; ``<= tensor_page_bytes[tensor_idx]``.

    Raises:
        InvalidTransferError: a field is not an int, ``tensor_idx < 0`` or ``page_size_bytes < 1``.
    """

    tensor_idx: int
    page_size_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_idx", check_int("LayerRef.tensor_idx", self.tensor_idx, minimum=0))
        object.__setattr__(self, "page_size_bytes",
                           check_int("LayerRef.page_size_bytes", self.page_size_bytes, minimum=1))


@dataclasses.dataclass(frozen=True)
class GroupRefs:
    """A group's refs as arrays, precomputed once per layout for the planner."""

    tensors: Int64Array  # Invariant: tensor_idx of each ref, in ref order.
    page_sizes: Int64Array  # Invariant: page_size_bytes of each ref, in ref order.
    bytes_per_block: int  # Invariant: == sum(page_sizes).

    @classmethod
    def of(cls, refs: tuple[LayerRef, ...]) -> GroupRefs:
        tensors = readonly(np.array([r.tensor_idx for r in refs], dtype=np.int64))
        sizes = readonly(np.array([r.page_size_bytes for r in refs], dtype=np.int64))
        return cls(tensors, sizes, sum(r.page_size_bytes for r in refs))


def _check_ref(ref: object, name: str, tensor_page_bytes: tuple[int, ...]) -> LayerRef:
    """Return ``ref`` if it is a LayerRef that fits ``tensor_page_bytes``, else raise InvalidTransferError."""
    if not isinstance(ref, LayerRef):
        raise InvalidTransferError(f"{name} must be a LayerRef (e.g. LayerRef(0, 512)), got {type(ref).__name__} "
                                   f"{ref!r}")
    if ref.tensor_idx >= len(tensor_page_bytes):
        raise InvalidTransferError(f"{name}.tensor_idx = {ref.tensor_idx} is out of range: "
                                   f"expected 0 <= tensor_idx < {len(tensor_page_bytes)}")
    limit = tensor_page_bytes[ref.tensor_idx]
    if ref.page_size_bytes > limit:
        raise InvalidTransferError(f"{name}.page_size_bytes = {ref.page_size_bytes} exceeds "
                                   f"tensor_page_bytes[{ref.tensor_idx}] = {limit}: expected <= {limit}")
    return ref


def _check_groups(groups: object, tensor_page_bytes: tuple[int, ...]) -> tuple[tuple[LayerRef, ...], ...]:
    """Validate the groups of a layout and return them as tuples."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise InvalidTransferError(f"groups must be a sequence of sequences of LayerRef (e.g. [[LayerRef(0, 512)]]), "
                                   f"got {type(groups).__name__} {groups!r}")
    result: list[tuple[LayerRef, ...]] = []
    for g, refs in enumerate(groups):
        if isinstance(refs, (str, bytes)) or not isinstance(refs, Iterable):
            raise InvalidTransferError(f"groups[{g}] must be a sequence of LayerRef (e.g. [LayerRef(0, 512)]), got "
                                       f"{type(refs).__name__} {refs!r}")
        group = tuple(_check_ref(r, f"groups[{g}][{i}]", tensor_page_bytes) for i, r in enumerate(refs))
        if not group:
            raise InvalidTransferError(f"groups[{g}] has no refs: expected at least one LayerRef per group")
        result.append(group)
    if not result:
        raise InvalidTransferError("groups is empty: expected at least one KV-cache group")
    return tuple(result)


@dataclasses.dataclass(frozen=True, init=False)
class KVCacheLayout:
    """The GPU tensors' page sizes and the KV-cache groups' layer refs. Immutable and validated.

    Args:
        tensor_page_bytes: row bytes of each GPU tensor (padding included); a list is accepted.
        groups: per KV-cache group, its refs in copy order; lists are accepted.

    Raises:
        InvalidTransferError: no tensor, a page size that is not an int in [1, 2**63 - 1], no group, a group without
            refs, a ref that is not a LayerRef, whose tensor_idx is out of range or whose page_size_bytes
            exceeds its tensor's page.
    """

    # Invariant: non-empty; every entry >= 1.
    tensor_page_bytes: tuple[int, ...]
    # Invariant: non-empty; each group non-empty; refs index tensors in range, page_size_bytes <= its tensor's page.
    groups: tuple[tuple[LayerRef, ...], ...]
    # Invariant: _group_refs[g] describes groups[g]; derived, so excluded from eq, hash and repr.
    _group_refs: tuple[GroupRefs, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __init__(self, tensor_page_bytes: Sequence[int], groups: Sequence[Sequence[LayerRef]]) -> None:
        # int64: the planner keeps pages in int64 arrays
        pages = check_int_tuple("tensor_page_bytes", tensor_page_bytes, minimum=1, maximum=INT64_MAX)
        if not pages:
            raise InvalidTransferError("tensor_page_bytes is empty: expected at least one tensor")
        checked = _check_groups(groups, pages)
        object.__setattr__(self, "tensor_page_bytes", pages)
        object.__setattr__(self, "groups", checked)
        object.__setattr__(self, "_group_refs", tuple(GroupRefs.of(g) for g in checked))

    @property
    def num_tensors(self) -> int:
        """Number of tensors (GPU tensors, and CPU views: one per GPU tensor)."""
        return len(self.tensor_page_bytes)

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups (a GPULoadStoreSpec carries one group size per group)."""
        return len(self.groups)

    def cpu_row_bytes(self, tensor_idx: int, blocks_per_chunk: int) -> int:
        """Bytes of one CPU row (chunk) of tensor ``tensor_idx``: its GPU page times ``blocks_per_chunk``.

        Raises:
            InvalidTransferError: ``tensor_idx`` out of range, or ``blocks_per_chunk < 1``.
        """
        idx = check_int("tensor_idx", tensor_idx, minimum=0)
        if idx >= self.num_tensors:
            raise InvalidTransferError(f"tensor_idx = {idx} is out of range: expected < {self.num_tensors}")
        return self.tensor_page_bytes[idx] * check_int("blocks_per_chunk", blocks_per_chunk, minimum=1)


# -------------------------------------------------------------------------------------------------- specs


class _BlockIDsSpec:
    """Common base of the two specs: an immutable 1-D int64 array of block ids."""

    __slots__ = ("_block_ids",)
    _block_ids: Int64Array  # Invariant: read-only, 1-D, int64, every id >= 0.

    def __init__(self, block_ids: npt.ArrayLike | Sequence[int]) -> None:
        object.__setattr__(self, "_block_ids", _as_block_ids(block_ids, type(self).__name__))

    @property
    def block_ids(self) -> Int64Array:
        """The block ids: a read-only 1-D int64 array."""
        return self._block_ids

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _key(self) -> tuple[object, ...]:
        return (self._block_ids.tobytes(),)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _BlockIDsSpec) or type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._key()))


class CPULoadStoreSpec(_BlockIDsSpec):
    """CPU chunk ids of one transfer (each id is a CPU row holding ``blocks_per_chunk`` GPU pages).

    Args:
        block_ids: 1-D integer ids >= 0 (a list of ints, or an integer numpy array); copied.

    Raises:
        InvalidTransferError: not 1-D, not integers (float rejected; a bool too, even mixed with ints in a
            list, which numpy would silently turn into 0 or 1), or a negative id (R7).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"CPULoadStoreSpec({self._block_ids.tolist()!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (CPULoadStoreSpec, (self._block_ids.tolist(),))


class GPULoadStoreSpec(_BlockIDsSpec):
    """GPU block ids of one transfer, with each KV-cache group's size and block index.

    Args:
        block_ids: 1-D integer ids >= 0, group after group; copied.
        group_sizes: blocks per group (>= 0); ``sum(group_sizes) == len(block_ids)``.
        block_indices: per group, the position of its first block within its first CPU chunk (>= 0); as long
            as ``group_sizes``. :func:`plan_copies` further requires ``< blocks_per_chunk`` (non-empty groups).

    Raises:
        InvalidTransferError: bad ids (see CPULoadStoreSpec), a size or index that is not a non-negative int,
            ``sum(group_sizes) != len(block_ids)`` or ``len(block_indices) != len(group_sizes)`` (R7).
    """

    __slots__ = ("_block_indices", "_group_sizes")
    _group_sizes: tuple[int, ...]  # Invariant: sum == len(block_ids); every entry >= 0.
    _block_indices: tuple[int, ...]  # Invariant: len == len(group_sizes); every entry >= 0.

    def __init__(self, block_ids: npt.ArrayLike | Sequence[int], group_sizes: Iterable[SupportsIndex],
                 block_indices: Iterable[SupportsIndex]) -> None:
        super().__init__(block_ids)
        sizes = check_int_tuple("GPULoadStoreSpec.group_sizes", group_sizes, minimum=0)
        indices = check_int_tuple("GPULoadStoreSpec.block_indices", block_indices, minimum=0)
        if sum(sizes) != len(self._block_ids):
            raise InvalidTransferError(f"GPULoadStoreSpec has {len(self._block_ids)} block ids, expected "
                                       f"sum(group_sizes) = {sum(sizes)} (group_sizes={sizes})")
        if len(indices) != len(sizes):
            raise InvalidTransferError(f"GPULoadStoreSpec has {len(indices)} block indices, expected one per "
                                       f"group: {len(sizes)} (group_sizes={sizes})")
        object.__setattr__(self, "_group_sizes", sizes)
        object.__setattr__(self, "_block_indices", indices)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Blocks per KV-cache group, in group order."""
        return self._group_sizes

    @property
    def block_indices(self) -> tuple[int, ...]:
        """Per group, the sub-block position of its first block inside its first CPU chunk."""
        return self._block_indices

    def _key(self) -> tuple[object, ...]:
        return (self._block_ids.tobytes(), self._group_sizes, self._block_indices)

    def __repr__(self) -> str:
        return (f"GPULoadStoreSpec({self._block_ids.tolist()!r}, group_sizes={self._group_sizes!r}, "
                f"block_indices={self._block_indices!r})")

    def __reduce__(self) -> tuple[object, ...]:
        return (GPULoadStoreSpec, (self._block_ids.tolist(), self._group_sizes, self._block_indices))



# ------------------------------------------------------------------------------------------------ geometry


def _check_one_geometry(geo: object, name: str, row_bytes: int, what: str) -> None:
    """Raise InvalidTransferError unless ``geo`` is a sane TensorGeometry whose rows are ``row_bytes`` long."""
    if not isinstance(geo, TensorGeometry):
        raise InvalidTransferError(f"{name} must be a TensorGeometry, got {type(geo).__name__}")
    ptr = check_int(f"{name}.ptr", geo.ptr, minimum=0)
    rows = check_int(f"{name}.rows", geo.rows, minimum=1)
    got = check_int(f"{name}.row_bytes", geo.row_bytes, minimum=1)
    stride = check_int(f"{name}.row_stride", geo.row_stride, minimum=1)
    if got != row_bytes:
        raise InvalidTransferError(f"{name}.row_bytes = {got} does not match the layout: expected {what} = "
                                   f"{row_bytes}")
    if stride < got:
        raise InvalidTransferError(f"{name}.row_stride = {stride} is smaller than its row: "
                                   f"expected row_stride >= {got}")
    if ptr + (rows - 1) * stride + got > INT64_MAX:
        raise InvalidTransferError(f"{name} ends beyond the int64 address range: expected its last byte "
                                   f"<= {INT64_MAX}")


def _plain_ok(geoms: Sequence[TensorGeometry], row_bytes: Sequence[int]) -> bool:
    """Fast path: True if every geometry is a TensorGeometry of plain ints passing :func:`_check_one_geometry`."""
    for geo, want in zip(geoms, row_bytes, strict=True):
        if type(geo) is not TensorGeometry:
            return False
        ptr, rows, got, stride = geo.ptr, geo.rows, geo.row_bytes, geo.row_stride
        if not (type(ptr) is int and type(rows) is int and type(got) is int and type(stride) is int):
            return False
        if ptr < 0 or rows < 1 or got != want or stride < got or ptr + (rows - 1) * stride + got > INT64_MAX:
            return False
    return True


def _columns(geoms: Sequence[TensorGeometry], side: str, row_bytes: Sequence[int], what: str) -> Int64Array:
    """Validate one side's geometries; return ``(ptr, rows, row_bytes, row_stride)`` as a ``(4, n)`` array.

    The fast path checks plain ints in one pass; otherwise each field is checked and the first problem raised.
    """
    if not _plain_ok(geoms, row_bytes):
        for t, expected in enumerate(row_bytes):
            _check_one_geometry(geoms[t], f"{side}[{t}]", expected, what.format(t=t))
    return np.array([[int(g.ptr), int(g.rows), int(g.row_bytes), int(g.row_stride)] for g in geoms],
                    dtype=np.int64).reshape(-1, 4).T


def geometry_columns(layout: KVCacheLayout, gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry],
                      bpc: int, cpu_pages: Sequence[int] | None = None) -> tuple[Int64Array, Int64Array]:
    """Validate both sides' geometry and return their ``(4, n)`` columns (see :func:`_columns`); ``cpu_pages``:
    each tensor's CPU sub-block when it is not its GPU page (canonical mode, R24)."""
    for side, geoms in (("GPU", gpu), ("CPU", cpu)):
        if not isinstance(geoms, Sequence):
            raise InvalidTransferError(f"{side} tensor geometries must be a sequence of TensorGeometry, "
                                       f"got {type(geoms).__name__}")
        if len(geoms) != layout.num_tensors:
            raise InvalidTransferError(f"got {len(geoms)} {side} tensor geometries, expected "
                                       f"{layout.num_tensors} (one per layout tensor)")
    pages = layout.tensor_page_bytes
    plain = cpu_pages is None or tuple(cpu_pages) == pages
    subs, what = (pages, "tensor_page_bytes") if plain else (tuple(cpu_pages or ()), "canonical page")
    return (_columns(gpu, "gpu", pages, "tensor_page_bytes[{t}]"),
            _columns(cpu, "cpu", [p * bpc for p in subs], what + "[{t}] * blocks_per_chunk"))


def check_geometry(layout: KVCacheLayout, gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry],
                   blocks_per_chunk: int, cpu_pages: Sequence[int] | None = None) -> None:
    """Check that the GPU tensors and CPU views fit ``layout`` with ``blocks_per_chunk`` GPU pages per CPU row.

    Args:
        layout: the KV-cache layout.
        gpu: one geometry per layout tensor; row_bytes must equal ``tensor_page_bytes[t]``.
        cpu: one geometry per layout tensor; row_bytes must equal ``tensor_page_bytes[t] * blocks_per_chunk``.
        blocks_per_chunk: GPU pages per CPU row, >= 1.
        cpu_pages: each tensor's CPU sub-block, when it is not its GPU page (canonical mode: the canonical page,
            R24); the CPU rows must then be ``cpu_pages[t] * blocks_per_chunk``.

    Raises:
        InvalidTransferError: counts differ from ``layout.num_tensors``, a row size differs from the layout, a
            row stride is smaller than its row, a tensor has no rows, or its addresses leave int64.
    """
    geometry_columns(layout, gpu, cpu, check_int("blocks_per_chunk", blocks_per_chunk, minimum=1), cpu_pages)

