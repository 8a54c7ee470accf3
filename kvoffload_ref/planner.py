"""The copy planner: a transfer's specs, on a fixed geometry, as byte copies (pure numpy).

Theory of operation
-------------------
:func:`plan_copies` turns a :class:`~kvoffload_ref.specs.GPULoadStoreSpec` and a
:class:`~kvoffload_ref.specs.CPULoadStoreSpec` into a :class:`CopyPlan`: three int64 arrays of absolute source
address, destination address and size, one entry per (block, ref). Groups are taken in order; a group of size 0
is skipped and uses no ids. For a group of size ``n`` with block index ``i`` the CPU side skips ``i`` sub-blocks
and consumes ``ceil((n + i) / blocks_per_chunk)`` chunk ids; the GPU side consumes ``n`` block ids. For every ref
of the group, in order, ``n`` descriptors follow: the sub-blocks of the consumed chunks in order, the first ``i``
dropped. The two id lists must be used up exactly. A non-empty group's block index must be ``< blocks_per_chunk``
(upstream reduces it modulo ``blocks_per_chunk``; this reference rejects larger values rather than guess); an
empty group's block index is ignored.

Worked example (reference §2.5): tensors t0, t1 of ``(64, 512)``, ``blocks_per_chunk = 3``, one group
``[LayerRef(0, 512), LayerRef(1, 512)]``, a CPU view of t0 at ``B0`` with row stride 8192. Loading CPU ``[10, 7]``
into GPU ``[5, 9, 1, 3]`` with ``block_indices=(2,)``: the sub-blocks are ``B0 + 10*8192 + {0, 512, 1024}`` then
``B0 + 7*8192 + {0, 512, 1024}``; drop 2, keep 4, so t0's sources are ``[B0+81920+1024, B0+57344,
B0+57344+512, B0+57344+1024]`` and its destinations ``[G0+2560, G0+4608, G0+512, G0+1536]``, 512 bytes each;
then t1 the same way. 8 descriptors, 4096 bytes.

*Destinations are written once.* A transfer whose copies write one destination twice is refused (R7): on the
GPU a destination is a (tensor, block id) pair, on the CPU a (tensor, chunk id, sub-block) triple, for every
tensor the group's refs name. Two groups that address the same block id in different tensors do not collide;
two groups sharing a tensor (a hybrid model's layers) do when they name the same block. Two refs of one group
naming one tensor copy the same bytes from the same source, so they are not counted twice. A repeated *source*
is legal (one block loaded into two places). The check costs one scatter into a per-planner scratch array in
the common case (all destination ids distinct), and the exact (tensor, position) comparison only when an id
repeats.

Rules: everything is validated before a plan is returned (R7) and invalid input raises
:class:`~kvoffload_ref.errors.InvalidTransferError`; nothing is mutated. The planner is vectorized: Python loops
run over tensors (geometry checks), groups, and sub-block positions within a chunk, never over blocks or refs.

A :class:`Planner` binds one layout, geometry and ``blocks_per_chunk`` (a handler's, for its lifetime): it
validates the geometry once and precomputes each group's per-ref factors, so a call only validates the specs
(completely: R7) and does the arithmetic. It plans in two steps -- :meth:`Planner.prepare` validates and knows the
descriptor count, :meth:`PreparedPlan.write` fills caller-provided (reused) int64 arrays -- so that no output is
allocated per transfer. :func:`plan_copies` is the one-call form: validate everything, return new arrays.

*Canonical mode* (R24, ``Planner(..., canonical=...)``, docs/canonical.md): the CPU sub-block of each tensor is its
canonical page and each (block, ref) copy becomes the mapping's fragments, with a store's blocks filtered by writer
(:class:`CanonicalPlan`); the validation is the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.canonical_plan import CanonicalLayout, check_canonical, cpu_pages, writer_mask
from kvoffload_ref.destinations import GroupSpan, RepeatTest, cpu_duplicate, gpu_duplicate
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.planner_fill import fill_cpu, fill_gpu, fill_one
from kvoffload_ref.specs import (
    CPULoadStoreSpec,
    Direction,
    GPULoadStoreSpec,
    GroupRefs,
    Int64Array,
    KVCacheLayout,
    TensorGeometry,
    check_int,
    geometry_columns,
)
from kvoffload_ref.validate import readonly

__all__ = ["CanonicalPlan", "CopyPlan", "Planner", "PreparedPlan", "plan_copies"]

#: How many spec shapes a planner remembers the group slicing of (then it forgets them all and starts again).
SLICE_SHAPES = 256
_INT64 = np.dtype(np.int64)  # an int64 array's dtype is usually this very object: ``is`` before ``!=``
_CONTIGUOUS = (8,)  # the strides of a 1-D C-contiguous int64 array


@dataclasses.dataclass(frozen=True, eq=False)
class CopyPlan:
    """The byte copies of one transfer: copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]``.

    Attributes:
        src: source addresses (read-only 1-D int64).
        dst: destination addresses (read-only 1-D int64).
        sizes: bytes per copy (read-only 1-D int64).
        num_ops: number of copies.
        nbytes: total bytes copied (the transfer size).
    """

    src: Int64Array  # Invariant: len == num_ops.
    dst: Int64Array  # Invariant: len == num_ops.
    sizes: Int64Array  # Invariant: len == num_ops; every entry >= 1.
    num_ops: int
    nbytes: int  # Invariant: == sum(sizes).

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CopyPlan):
            return NotImplemented
        return (self.num_ops == other.num_ops and self.nbytes == other.nbytes
                and all(np.array_equal(a, b) for a, b in
                        ((self.src, other.src), (self.dst, other.dst), (self.sizes, other.sizes))))

    __hash__ = None  # type: ignore[assignment]  # arrays inside: equal plans need not hash alike


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side's validated geometry, as arrays indexed by tensor (built once per :class:`Planner`)."""

    name: str  # Invariant: "GPU" or "CPU" (used in messages).
    label: str  # Invariant: "gpu" or "cpu" (the geometry list's name in messages).
    spec_name: str  # Invariant: the spec class and argument that hold this side's ids, for messages.
    ptr: Int64Array
    stride: Int64Array
    rows: Int64Array

    @classmethod
    def of(cls, name: str, spec_name: str, cols: Int64Array) -> _Side:
        """Build a side from its validated ``(4, n)`` geometry columns."""
        ptr, rows, _, stride = cols
        return cls(name, name.lower(), spec_name, ptr, stride, rows)


@dataclasses.dataclass(frozen=True)
class _GroupColumns:
    """One KV-cache group's refs resolved against both sides' geometry: the per-ref factors of its descriptors,
    as ``(refs, 1)`` columns (``(refs, bpc)`` for the CPU sub-block offsets), computed once per Planner."""

    refs: GroupRefs
    gpu_ptr: Int64Array
    gpu_stride: Int64Array
    gpu_rows: int  # Invariant: the fewest GPU rows among the group's tensors (an id below it fits all).
    cpu_ptr: Int64Array
    cpu_stride: Int64Array
    cpu_rows: int  # Invariant: the same for the CPU views.
    cpu_subs: Int64Array  # Invariant: cpu_subs[r, j] = j * tensor_page_bytes[tensor of ref r].
    page_sizes: Int64Array
    # Invariant: the same factors flat, per ref, for a slice of one block (a small job's): gpu_ptr as a 1-D array,
    # gpu_stride and cpu_stride as 1-D arrays or, where every ref's is the same (as usual), that one stride as an
    # int (``fill_one``); cpu_firsts[j] = cpu_ptr + cpu_subs[:, j] (the sub-block j of chunk 0, per ref).
    gpu_ptr1: Int64Array
    gpu_stride1: Int64Array | int
    cpu_stride1: Int64Array | int
    cpu_firsts: tuple[Int64Array, ...]

    @classmethod
    def of(cls, refs: GroupRefs, gpu: _Side, cpu: _Side, pages: Int64Array, bpc: int) -> _GroupColumns:
        t = refs.tensors
        subs = pages[t][:, None] * np.arange(bpc, dtype=np.int64)[None, :]
        firsts = tuple(readonly(cpu.ptr[t] + subs[:, j]) for j in range(bpc))
        return cls(refs, gpu.ptr[t][:, None], gpu.stride[t][:, None], int(gpu.rows[t].min()),
                   cpu.ptr[t][:, None], cpu.stride[t][:, None], int(cpu.rows[t].min()), subs,
                   refs.page_sizes[:, None], readonly(gpu.ptr[t]), _one_or_each(gpu.stride[t]),
                   _one_or_each(cpu.stride[t]), firsts)


def _one_or_each(strides: Int64Array) -> Int64Array | int:
    """The one stride all of a group's refs share (an int), or each ref's (a read-only 1-D array)."""
    return int(strides[0]) if len(strides) and (strides == strides[0]).all() else readonly(strides)


class _Slice(NamedTuple):
    """The ids one non-empty group consumes on each side (a tuple: one is made per group per transfer, and a frozen
    dataclass sets each field through ``object.__setattr__``)."""

    group: int
    size: int  # Invariant: >= 1 (empty groups get no slice).
    skip: int  # Invariant: 0 <= skip < blocks_per_chunk (CPU side; the GPU side never skips).
    gpu_off: int
    cpu_off: int
    cpu_count: int  # Invariant: == ceil((size + skip) / blocks_per_chunk).


_SpecT = TypeVar("_SpecT", GPULoadStoreSpec, CPULoadStoreSpec)


def _expect(spec: object, cls: type[_SpecT], arg: str, direction: str) -> _SpecT:
    """Return ``spec`` if it is a ``cls``, else raise InvalidTransferError naming the expected type."""
    if not isinstance(spec, cls):
        raise InvalidTransferError(f"{direction}: {arg} must be a {cls.__name__}, got {type(spec).__name__}")
    return spec


def _specs_for(direction: object, src_spec: object,
               dst_spec: object) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    """Return (gpu_spec, cpu_spec) for ``direction``; src is checked before dst."""
    if direction == "store":
        if isinstance(src_spec, GPULoadStoreSpec) and isinstance(dst_spec, CPULoadStoreSpec):
            return src_spec, dst_spec  # the common case, with no call per spec
        gpu_spec = _expect(src_spec, GPULoadStoreSpec, "src_spec", direction)
        return gpu_spec, _expect(dst_spec, CPULoadStoreSpec, "dst_spec", direction)
    if direction == "load":
        if isinstance(src_spec, CPULoadStoreSpec) and isinstance(dst_spec, GPULoadStoreSpec):
            return dst_spec, src_spec
        cpu_spec = _expect(src_spec, CPULoadStoreSpec, "src_spec", direction)
        return _expect(dst_spec, GPULoadStoreSpec, "dst_spec", direction), cpu_spec
    raise InvalidTransferError(f"direction must be 'store' or 'load', got {direction!r}")


def _slice_groups(layout: KVCacheLayout, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec,
                  bpc: int) -> list[_Slice]:
    """Split both id lists among the non-empty groups (reference §2.4), checking that they match exactly."""
    sizes, indices = gpu_spec.group_sizes, gpu_spec.block_indices
    if len(sizes) != layout.num_groups:
        raise InvalidTransferError(f"GPULoadStoreSpec has {len(sizes)} group sizes, expected "
                                   f"{layout.num_groups} (one per KV-cache group of the layout)")
    slices: list[_Slice] = []
    gpu_off = cpu_off = 0
    for g, (size, index) in enumerate(zip(sizes, indices, strict=True)):
        if size == 0:
            continue  # an empty group uses no ids on either side; its block index is ignored
        if index >= bpc:
            raise InvalidTransferError(f"block_indices[{g}] = {index} is out of range: expected "
                                       f"0 <= block index < blocks_per_chunk = {bpc}")
        count = -(-(size + index) // bpc)
        slices.append(_Slice(g, size, index, gpu_off, cpu_off, count))
        gpu_off, cpu_off = gpu_off + size, cpu_off + count
    if cpu_off != len(cpu_spec.block_ids):
        raise InvalidTransferError(f"CPULoadStoreSpec has {len(cpu_spec.block_ids)} block ids, expected "
                                   f"{cpu_off} (group_sizes={sizes}, block_indices={indices}, "
                                   f"blocks_per_chunk={bpc})")
    return slices


def _check_ids_in_range(side: _Side, ids: Int64Array, offset: int, least_rows: int, refs: GroupRefs,
                        group: int) -> None:
    """Raise InvalidTransferError unless every id is a row of every tensor the group's refs use (all of them
    have at least ``least_rows`` rows)."""
    if ids.size == 0 or int(ids[0] if ids.size == 1 else ids.max()) < least_rows:   # one id: no reduction
        return
    rows = side.rows[refs.tensors]
    pos = int(np.flatnonzero(ids >= least_rows)[0])
    bad = int(ids[pos])
    tensor = int(refs.tensors[int(np.flatnonzero(rows <= bad)[0])])
    raise InvalidTransferError(
        f"{side.name} block id {bad} ({side.spec_name}.block_ids[{offset + pos}]) is out of range for "
        f"{side.label}[{tensor}] (group {group}): expected 0 <= id < {int(side.rows[tensor])}")


class PreparedPlan:
    """One transfer, validated (R7) but not yet written out: how many descriptors and bytes it has, and
    :meth:`write` to lay them out into caller-provided arrays (or :meth:`to_plan` into new ones).

    Made by :meth:`Planner.prepare`. Writing cannot fail on valid output arrays: everything that can be wrong
    with the transfer was checked when this was made.

    Attributes:
        num_ops: number of copies.
        nbytes: total bytes copied.
        gpu_ids, cpu_ids: the checked specs' block ids (read-only 1-D int64 arrays): the GPU spec's, the CPU spec's.
    """

    __slots__ = ("_planner", "_slices", "_store", "cpu_ids", "gpu_ids", "nbytes", "num_ops")

    def __init__(self, planner: Planner, gpu_ids: Int64Array, cpu_ids: Int64Array, slices: list[_Slice],
                 store: bool) -> None:
        self._planner = planner
        # Invariant: the specs' read-only id arrays (specs are immutable), validated against the geometry.
        self.gpu_ids, self.cpu_ids = gpu_ids, cpu_ids
        self._slices = slices
        self._store = store
        groups, num_ops, nbytes = planner._columns, 0, 0
        for s in slices:   # one pass, no generator (a one-block job has one slice)
            refs = groups[s.group].refs
            num_ops += s.size * len(refs.tensors)
            nbytes += s.size * refs.bytes_per_block
        self.num_ops: int = num_ops
        self.nbytes: int = nbytes

    def write(self, src: Int64Array, dst: Int64Array, sizes: Int64Array) -> int:
        """Write the copies into the first :attr:`num_ops` entries of ``src``, ``dst`` and ``sizes``, in the
        order :func:`plan_copies` returns them; the entries after those are left alone.

        Args:
            src, dst, sizes: writeable 1-D int64 arrays of at least ``num_ops`` entries each (for example a
                descriptor buffer's).

        Returns:
            ``num_ops``.

        Raises:
            ValueError: an array that is not 1-D int64, is read-only or is too short (nothing written).
        """
        n = self.num_ops
        if type(src) is type(dst) is type(sizes) is np.ndarray and src.dtype is dst.dtype is sizes.dtype is _INT64 \
                and src.strides == dst.strides == sizes.strides == _CONTIGUOUS and src.shape[0] >= n \
                and dst.shape[0] >= n and sizes.shape[0] >= n and src.flags.writeable and dst.flags.writeable \
                and sizes.flags.writeable:  # the common case (a descriptor buffer's): all checked in one test
            self._write(src, dst, sizes)
            return n
        for name, array in (("src", src), ("dst", dst), ("sizes", sizes)):
            if not isinstance(array, np.ndarray) or (array.dtype is not _INT64 and array.dtype != np.int64) \
                    or array.ndim != 1 or array.shape[0] < n or not array.flags.writeable:
                raise ValueError(f"PreparedPlan.write: {name} must be a writeable 1-D int64 array of at least "
                                 f"{n} entries")
        if src.strides[0] == dst.strides[0] == sizes.strides[0] == 8:   # 1-D int64 with 8-byte steps: contiguous
            self._write(src, dst, sizes)   # it writes the first n entries alone (no slices of n made first)
        else:   # the reshapes below must be views: fill contiguous arrays, then copy them over
            targets = (src[:n], dst[:n], sizes[:n])
            staged = [np.empty(n, dtype=np.int64) for _ in targets]
            self._write(*staged)
            for target, values in zip(targets, staged, strict=True):
                target[...] = values
        return n

    def to_plan(self) -> CopyPlan:
        """The copies as a new :class:`CopyPlan` (read-only arrays the caller keeps)."""
        src, dst, sizes = (np.empty(self.num_ops, dtype=np.int64) for _ in range(3))
        self._write(src, dst, sizes)
        return CopyPlan(readonly(src), readonly(dst), readonly(sizes), self.num_ops, self.nbytes)

    def _write(self, src: Int64Array, dst: Int64Array, sizes: Int64Array) -> None:
        """Lay the descriptors out group-major, then ref, then block, into the first num_ops entries of C-contiguous
        arrays (the entries after those are left alone)."""
        gpu_out, cpu_out = (src, dst) if self._store else (dst, src)
        columns, bpc = self._planner._columns, self._planner.blocks_per_chunk
        pos = 0
        for s in self._slices:
            cols = columns[s.group]
            refs = len(cols.refs.tensors)
            end = pos + s.size * refs
            if s.size == 1:   # one block (a small job): per ref, one GPU page and one CPU sub-block, flat
                fill_one(gpu_out[pos:end], cols.gpu_ptr1, cols.gpu_stride1, self.gpu_ids.item(s.gpu_off))
                fill_one(cpu_out[pos:end], cols.cpu_firsts[s.skip], cols.cpu_stride1,
                         self.cpu_ids.item(s.cpu_off))
                sizes[pos:end] = cols.refs.page_sizes
                pos = end
                continue
            shape = (refs, s.size)
            fill_gpu(gpu_out[pos:end].reshape(shape), cols.gpu_ptr, cols.gpu_stride,
                     self.gpu_ids[s.gpu_off:s.gpu_off + s.size])
            fill_cpu(cpu_out[pos:end].reshape(shape), cols.cpu_ptr, cols.cpu_stride, cols.cpu_subs,
                     self.cpu_ids[s.cpu_off:s.cpu_off + s.cpu_count], s.skip, bpc)
            sizes[pos:end].reshape(shape)[...] = cols.page_sizes
            pos = end


class CanonicalPlan(PreparedPlan):
    """A :class:`PreparedPlan` in canonical mode (R24): each (block, ref) copy is the ref's tensor mapping's
    fragments at the block's base addresses (the CPU sub-block being the canonical page), block-major; a store
    keeps only the blocks whose CPU canonical page ``chunk_id * blocks_per_chunk + j`` this rank writes. The
    fragments were unrolled once per mapping and stacked per group when the planner was built; per transfer a
    Python loop runs over groups (and over refs only where a group's refs differ in fragment count or writers),
    numpy over refs, blocks and fragments.
    """

    __slots__ = ("_keep",)

    def __init__(self, planner: Planner, gpu_ids: Int64Array, cpu_ids: Int64Array, slices: list[_Slice],
                 store: bool, canonical: CanonicalLayout) -> None:
        super().__init__(planner, gpu_ids, cpu_ids, slices, store)
        bpc = planner.blocks_per_chunk
        # Invariant: _keep[i][r]: the blocks of slice i that ref r copies (None: all of them; loads never filter).
        # Refs whose mappings have the same writers share one mask object (the write checks ``is``).
        self._keep: list[list[npt.NDArray[np.bool_] | None]] = []
        self.num_ops = self.nbytes = 0
        for s in slices:
            fragments, nbytes, filtered = planner._totals[s.group]
            if not (store and filtered):  # every block copies (a load, or one writer per page)
                self._keep.append(planner._unfiltered[s.group])
                self.num_ops += s.size * fragments
                self.nbytes += s.size * nbytes
                continue
            pos = s.skip + np.arange(s.size, dtype=np.int64)
            pages = cpu_ids[s.cpu_off + pos // bpc] * bpc + pos % bpc  # the CPU canonical page ids
            keep: list[npt.NDArray[np.bool_] | None] = []
            masks: dict[tuple[int, int], npt.NDArray[np.bool_]] = {}
            for t in planner.layout._group_refs[s.group].tensors.tolist():
                mapping = canonical.mappings[t]
                writers = (mapping.num_writers, mapping.writer_index)
                mask = None
                if store and mapping.num_writers > 1:
                    mask = masks[writers] if writers in masks else masks.setdefault(writers,
                                                                                   writer_mask(mapping, pages))
                active = s.size if mask is None else int(np.count_nonzero(mask))
                keep.append(mask)
                self.num_ops += active * mapping.num_fragments
                self.nbytes += active * mapping.copied_bytes
            self._keep.append(keep)

    def _write(self, src: Int64Array, dst: Int64Array, sizes: Int64Array) -> None:
        """Group-major, then ref, then block, then fragment (the first num_ops entries alone)."""
        gpu_out, cpu_out = (src, dst) if self._store else (dst, src)
        planner = self._planner
        canonical, bpc = planner.canonical, planner.blocks_per_chunk
        assert canonical is not None  # Invariant: a CanonicalPlan is made by a canonical planner only
        pos = 0
        for s, keep in zip(self._slices, self._keep, strict=True):
            cols = planner._columns[s.group]
            shape = (len(cols.refs.tensors), s.size)
            gpu_base, cpu_base = np.empty(shape, dtype=np.int64), np.empty(shape, dtype=np.int64)
            fill_gpu(gpu_base, cols.gpu_ptr, cols.gpu_stride, self.gpu_ids[s.gpu_off:s.gpu_off + s.size])
            fill_cpu(cpu_base, cols.cpu_ptr, cols.cpu_stride, cols.cpu_subs,
                     self.cpu_ids[s.cpu_off:s.cpu_off + s.cpu_count], s.skip, bpc)
            tables = planner._fragments[s.group]
            if tables is not None and all(mask is keep[0] for mask in keep):  # one op per column for all refs
                mask = keep[0]
                g, c = (gpu_base, cpu_base) if mask is None else (gpu_base[:, mask], cpu_base[:, mask])
                end = pos + g.size * tables[0].shape[1]
                cube = (g.shape[0], g.shape[1], tables[0].shape[1])  # refs x blocks x fragments
                np.add(g[:, :, None], tables[0][:, None, :], out=gpu_out[pos:end].reshape(cube))
                np.add(c[:, :, None], tables[1][:, None, :], out=cpu_out[pos:end].reshape(cube))
                same = tables[2][:, :1]  # one size per ref (as NHD rows are): a broadcast fill, much faster
                np.copyto(sizes[pos:end].reshape(cube), same[:, :, None] if (tables[2] == same).all()
                          else tables[2][:, None, :])
                pos = end
                continue
            for r, (t, mask) in enumerate(zip(cols.refs.tensors.tolist(), keep, strict=True)):
                local, can, frag = canonical.mappings[t].fragments()
                g, c = (gpu_base[r], cpu_base[r]) if mask is None else (gpu_base[r][mask], cpu_base[r][mask])
                end = pos + len(g) * len(frag)
                block_major = (len(g), len(frag))
                np.add(g[:, None], local[None, :], out=gpu_out[pos:end].reshape(block_major))
                np.add(c[:, None], can[None, :], out=cpu_out[pos:end].reshape(block_major))
                sizes[pos:end].reshape(block_major)[...] = frag
                pos = end


class Planner:
    """The copy planner for one fixed layout, tensor geometry and ``blocks_per_chunk`` (a handler's).

    The geometry is validated once, here, by :func:`check_geometry`'s rules, and what every plan needs from it
    is precomputed; each transfer's specs are still validated completely, on every call (R7). Planning in two
    steps lets a caller learn the number of descriptors before it provides the arrays they go into:
    ``prepared = planner.prepare(...)`` validates (and raises) and ``prepared.write(src, dst, sizes)`` fills
    reused arrays without allocating. ``planner.plan(...)`` is ``plan_copies`` with the geometry bound.

    Args:
        layout: the KV-cache layout.
        gpu: geometry of each GPU tensor (copied: later changes to the sequence do not matter).
        cpu: geometry of each CPU view.
        blocks_per_chunk: GPU pages per CPU row, >= 1.
        canonical: this rank's canonical mappings (R24): the CPU rows are then ``canonical page *
            blocks_per_chunk`` and plans are :class:`CanonicalPlan` s; None: plain mode.

    Raises:
        InvalidTransferError: what :func:`check_geometry` raises, or mappings that do not fit the layout
            (:func:`~kvoffload_ref.canonical_plan.check_canonical`).
    """

    def __init__(self, layout: KVCacheLayout, gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry],
                 blocks_per_chunk: int, canonical: CanonicalLayout | None = None) -> None:
        bpc = check_int("blocks_per_chunk", blocks_per_chunk, minimum=1)
        # Invariant: None (plain mode) or this rank's mappings, fitting the layout (R24; see canonical_plan).
        self.canonical = check_canonical(layout, canonical)
        gpu_cols, cpu_cols = geometry_columns(layout, gpu, cpu, bpc, cpu_pages(layout, canonical))
        self.layout = layout
        self.blocks_per_chunk = bpc
        self._gpu = _Side.of("GPU", "GPULoadStoreSpec", gpu_cols)
        self._cpu = _Side.of("CPU", "CPULoadStoreSpec", cpu_cols)
        pages = np.array(cpu_pages(layout, canonical), dtype=np.int64)  # the CPU sub-block of each tensor
        # Invariant: _columns[g] describes layout.groups[g] on this geometry.
        self._columns = tuple(_GroupColumns.of(refs, self._gpu, self._cpu, pages, bpc)
                              for refs in layout._group_refs)
        # Invariant: in canonical mode, _fragments[g] is (local, canonical, sizes) offsets as refs x fragments
        # tables of layout.groups[g] (unrolled once) when its refs' mappings have as many fragments; else None.
        self._fragments = tuple(self._tables(refs) for refs in layout._group_refs)
        # Invariant: in canonical mode, per group: (fragments per block over its refs, bytes per block, whether some
        # ref's mapping has several writers) and a no-filter mask list (one None per ref); else unused.
        self._totals = tuple(self._sums(refs) for refs in layout._group_refs)
        self._unfiltered: tuple[list[npt.NDArray[np.bool_] | None], ...] = tuple(
            [None] * len(refs.tensors) for refs in layout._group_refs)
        # Invariant: _distinct[g] is the sorted distinct tensors of layout.groups[g] (what a destination key names).
        self._distinct = tuple(np.unique(refs.tensors) for refs in layout._group_refs)
        # Invariant: each tests ids below its side's largest row count (ids are range-checked before).
        self._gpu_repeats = RepeatTest(int(self._gpu.rows.max()))
        self._cpu_repeats = RepeatTest(int(self._cpu.rows.max()))
        # Invariant: (group_sizes, block_indices, CPU id count) -> what _slice_groups returned for them (they alone
        # decide it on this planner); only shapes that passed its checks; emptied when SLICE_SHAPES are held.
        self._shapes: dict[tuple[tuple[int, ...], tuple[int, ...], int], list[_Slice]] = {}

    def _sums(self, refs: GroupRefs) -> tuple[int, int, bool]:
        if self.canonical is None:
            return 0, 0, False
        mappings = [self.canonical.mappings[t] for t in refs.tensors.tolist()]
        return (sum(m.num_fragments for m in mappings), sum(m.copied_bytes for m in mappings),
                any(m.num_writers > 1 for m in mappings))

    def _tables(self, refs: GroupRefs) -> tuple[Int64Array, Int64Array, Int64Array] | None:
        if self.canonical is None:
            return None
        unrolled = [self.canonical.mappings[t].fragments() for t in refs.tensors.tolist()]
        if len({len(u[0]) for u in unrolled}) != 1:
            return None
        return readonly(np.stack([u[0] for u in unrolled])), readonly(np.stack([u[1] for u in unrolled])), \
            readonly(np.stack([u[2] for u in unrolled]))

    def prepare(self, direction: Direction, src_spec: GPULoadStoreSpec | CPULoadStoreSpec,
                dst_spec: GPULoadStoreSpec | CPULoadStoreSpec) -> PreparedPlan:
        """Validate one transfer (R7) and return it ready to be written out.

        Raises:
            InvalidTransferError: what :func:`plan_copies` raises for the direction and the specs.
        """
        gpu_spec, cpu_spec = _specs_for(direction, src_spec, dst_spec)
        return self._prepare(gpu_spec, cpu_spec, direction == "store")

    def plan(self, direction: Direction, src_spec: GPULoadStoreSpec | CPULoadStoreSpec,
             dst_spec: GPULoadStoreSpec | CPULoadStoreSpec) -> CopyPlan:
        """:func:`plan_copies` on this planner's layout, geometry and blocks_per_chunk."""
        return self.prepare(direction, src_spec, dst_spec).to_plan()

    def _prepare(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, store: bool) -> PreparedPlan:
        gpu_ids, cpu_ids = gpu_spec.block_ids, cpu_spec.block_ids
        slices = self._slices(gpu_spec, cpu_spec, len(cpu_ids))
        for s in slices:
            cols = self._columns[s.group]
            if s.size == 1 == s.cpu_count and gpu_ids.item(s.gpu_off) < cols.gpu_rows \
                    and cpu_ids.item(s.cpu_off) < cols.cpu_rows:
                continue   # one id per side, in range (a one-block job): no slices of the ids made
            _check_ids_in_range(self._gpu, gpu_ids[s.gpu_off:s.gpu_off + s.size], s.gpu_off, cols.gpu_rows,
                                cols.refs, s.group)
            _check_ids_in_range(self._cpu, cpu_ids[s.cpu_off:s.cpu_off + s.cpu_count], s.cpu_off, cols.cpu_rows,
                                cols.refs, s.group)
        if len(cpu_ids if store else gpu_ids) > 1:  # R7 (one destination id, a one-block job's, cannot repeat)
            if store:
                self._check_cpu_destinations(slices, cpu_ids)
            else:
                self._check_gpu_destinations(slices, gpu_ids)
        if self.canonical is not None:
            return CanonicalPlan(self, gpu_ids, cpu_ids, slices, store, self.canonical)
        return PreparedPlan(self, gpu_ids, cpu_ids, slices, store)

    def _slices(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, cpu_count: int) -> list[_Slice]:
        """:func:`_slice_groups` of the specs (``cpu_count``: the CPU spec's id count), remembered per shape (a
        server's jobs come in a few shapes: one block at each block index, a prompt's chunk...); the slices are never
        changed by their users."""
        key = (gpu_spec.group_sizes, gpu_spec.block_indices, cpu_count)
        found = self._shapes.get(key)
        if found is None:
            found = _slice_groups(self.layout, gpu_spec, cpu_spec, self.blocks_per_chunk)  # raises: not kept
            if len(self._shapes) >= SLICE_SHAPES:
                self._shapes.clear()
            self._shapes[key] = found
        return found

    def _check_gpu_destinations(self, slices: list[_Slice], ids: Int64Array) -> None:
        """R7: refuse a load that writes one (tensor, GPU block) twice; cheap unless an id repeats."""
        if not self._gpu_repeats.any_repeat(ids):
            return
        found = gpu_duplicate([GroupSpan(self._distinct[s.group], s.gpu_off, 0, s.size) for s in slices], ids)
        if found is not None:
            tensor, block, first, second = found
            raise InvalidTransferError(
                f"load: GPU block {block} of tensor {tensor} is a destination twice (GPULoadStoreSpec.block_ids"
                f"[{first}] and [{second}]): expected each destination written once per transfer (a repeated "
                "source is fine)")

    def _check_cpu_destinations(self, slices: list[_Slice], ids: Int64Array) -> None:
        """R7: refuse a store that writes one (tensor, CPU chunk, sub-block) twice; cheap unless an id repeats."""
        if not self._cpu_repeats.any_repeat(ids):
            return
        spans = [GroupSpan(self._distinct[s.group], s.cpu_off, s.skip, s.size) for s in slices]
        found = cpu_duplicate(spans, ids, self.blocks_per_chunk)
        if found is not None:
            tensor, chunk, sub, first, second = found
            raise InvalidTransferError(
                f"store: CPU chunk {chunk} sub-block {sub} of tensor {tensor} is a destination twice "
                f"(CPULoadStoreSpec.block_ids[{first}] and [{second}]): expected each destination written once "
                "per transfer (a repeated source is fine)")


def plan_copies(
    layout: KVCacheLayout, direction: Direction, src_spec: GPULoadStoreSpec | CPULoadStoreSpec,
    dst_spec: GPULoadStoreSpec | CPULoadStoreSpec, gpu: Sequence[TensorGeometry],
    cpu: Sequence[TensorGeometry], blocks_per_chunk: int,
) -> CopyPlan:
    """Plan the byte copies of one transfer (reference §2.3/§2.4), validating everything first (R7).

    Validates the geometry on every call and returns new arrays; a caller planning many transfers on one
    geometry (the handler) uses a :class:`Planner`, which validates the geometry once and can write into reused
    arrays. Both give the same copies and raise the same errors.

    Args:
        layout: the KV-cache layout.
        direction: ``"store"`` (src GPU spec, dst CPU spec) or ``"load"`` (src CPU spec, dst GPU spec).
        src_spec: the source spec for ``direction``.
        dst_spec: the destination spec for ``direction``.
        gpu: geometry of each GPU tensor (one row per GPU block).
        cpu: geometry of each CPU view (one row per CPU chunk of ``blocks_per_chunk`` GPU pages).
        blocks_per_chunk: GPU pages per CPU row, >= 1.

    Returns:
        The copies, group-major, then ref, then block; sizes are each ref's unpadded page size. All group
        sizes 0 with empty id lists gives an empty plan.

    Raises:
        InvalidTransferError: unknown direction; a spec of the wrong type; bad geometry (see check_geometry);
            ``len(group_sizes) != layout.num_groups``; a non-empty group's block index ``>= blocks_per_chunk``;
            a CPU id count other than the groups need; an id ``>=`` the rows of a tensor it indexes; a
            destination written twice (a (tensor, GPU block) of a load, a (tensor, CPU chunk, sub-block) of a
            store).
    """
    gpu_spec, cpu_spec = _specs_for(direction, src_spec, dst_spec)
    planner = Planner(layout, gpu, cpu, blocks_per_chunk)
    return planner._prepare(gpu_spec, cpu_spec, direction == "store").to_plan()
