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

:func:`check_int` is the one integer validator of the package: a Python int or a numpy integer is accepted (and
returned as a Python int), a bool, float or string is refused with :class:`~kvoffload_ref.errors.InvalidTransferError`
naming the parameter. Every size, index and count a caller passes goes through it.

:func:`check_seconds` (a duration) and :func:`check_positive` (a rate, a horizon) are its counterparts for real
numbers, and :func:`check_timeout` for a wait's bound: each refuses a bool, a non-number, NaN, an out-of-range
value, an infinity where a finite value is meant and an int too large for a float (``10**400``: ``float()`` of it
overflows) *before* any arithmetic, and returns a Python float. Their messages never print an int of more than
128 bits in full (``str()`` of an int over 4300 digits raises).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Final, Literal, SupportsIndex

import numpy as np
import numpy.typing as npt

from kvoffload_ref.errors import InvalidTransferError

__all__ = [
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

Int64Array = npt.NDArray[np.int64]
#: ``"store"`` copies GPU -> CPU, ``"load"`` copies CPU -> GPU.
Direction = Literal["store", "load"]

INT64_MAX: Final = 2**63 - 1


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


#: Ints of more bits than this are named by their size in messages, not printed.
_SHOWN_BITS: Final = 128
#: The types a real-number validator accepts (a bool, an int subclass, is refused separately).
_REAL: Final = (int, float, np.integer, np.floating)


def _show(value: object) -> str:
    """``repr(value)``, except for an int of more than 128 bits: "an int of N bits" (``str()`` of an int of more
    than 4300 digits raises ValueError, and a 400-digit number helps no one)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        bits = int(value).bit_length()
        if bits > _SHOWN_BITS:
            return f"{'a negative' if value < 0 else 'an'} int of {bits} bits"
    return repr(value)


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """The package's one integer validator: return ``value`` as a Python int, or refuse it (R7).

    Args:
        name: the parameter's name, as the caller wrote it (used in the message).
        value: a Python int or a numpy integer (``np.int64(2)`` is as good as ``2``); a bool (Python or numpy),
            a float, a string or anything else is refused with "``name`` must be an int, got <type> <value>".
        minimum: the smallest accepted value (None: no bound).
        maximum: the largest accepted value (None: no bound). Without one, any Python int is returned: a caller
            that converts the value to a fixed-width integer (a numpy int64 array, an address) passes the bound
            that conversion needs (e.g. ``INT64_MAX``).

    Returns:
        ``value`` as a plain Python int.

    Raises:
        InvalidTransferError: not an int (the message names ``name`` and what to pass), or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTransferError(f"{name} must be an int, got {type(value).__name__} {_show(value)}")
    result = int(value)
    if (minimum is not None and result < minimum) or (maximum is not None and result > maximum):
        if maximum is None:
            raise InvalidTransferError(f"{name} must be >= {minimum}, got {_show(result)}")
        if minimum is None:
            raise InvalidTransferError(f"{name} must be <= {maximum}, got {_show(result)}")
        raise InvalidTransferError(f"{name} must be an int in [{minimum}, {maximum}], got {_show(result)}")
    return result


def _check_real(name: str, value: object, *, unit: str, positive: bool, allow_inf: bool) -> float:
    """The real-number validator behind :func:`check_seconds`, :func:`check_positive` and :func:`check_timeout`.

    Returns ``value`` as a Python float (``math.inf`` only with ``allow_inf``); every check runs before any
    arithmetic on the value. See :func:`check_seconds` for what is refused.
    """
    if type(value) is float and (value > 0.0 if positive else value >= 0.0) and value < math.inf:
        return value  # the common case, in one comparison chain (sleep() and every wait come through here)
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, _REAL):
        raise InvalidTransferError(f"{name} must be a number of {unit} {bound} (an int or a float), got "
                                   f"{type(value).__name__} {_show(value)}")
    if isinstance(value, (int, np.integer)):
        exact = int(value)
        if exact < 0 or (positive and exact == 0):
            what = "negative" if exact < 0 else "zero"
            raise InvalidTransferError(f"{name} = {_show(exact)} is {what}: expected a number of {unit} {bound}")
        try:
            return float(exact)
        except OverflowError:
            raise InvalidTransferError(
                f"{name} = {_show(exact)} is too large: it does not fit in a float (at most "
                f"{sys.float_info.max:.4g} {unit})" + ("; pass math.inf for no bound" if allow_inf else "")
            ) from None
    number = float(value)  # a float or a numpy floating (a long double beyond the float range becomes inf)
    if math.isnan(number):
        raise InvalidTransferError(f"{name} is NaN: expected a number of {unit} {bound}")
    if number < 0 or (positive and number == 0):
        what = "negative" if number < 0 else "zero"
        raise InvalidTransferError(f"{name} = {_show(value)} is {what}: expected a number of {unit} {bound}")
    if math.isinf(number):
        if not np.isinf(value):  # a numpy floating beyond the float range (a long double)
            raise InvalidTransferError(f"{name} = {_show(value)} is too large: it does not fit in a float (at most "
                                       f"{sys.float_info.max:.4g} {unit})")
        if not allow_inf:
            raise InvalidTransferError(f"{name} is infinite: expected a finite number of {unit} {bound}")
    return number


def check_seconds(name: str, value: object, *, allow_inf: bool = False) -> float:
    """A duration in seconds a caller passes (a policy's timeout, a sleep, a latency): a real number >= 0 (R7).

    Args:
        name: the parameter's name, as the caller wrote it (used in the message).
        value: an int, a float, or a numpy integer or floating.
        allow_inf: accept ``math.inf`` (returned as is: the caller reads it as "no bound"); refused by default.

    Returns:
        ``value`` as a Python float, finite unless ``allow_inf``.

    Raises:
        InvalidTransferError: a bool (``True`` is not one second), a non-number (the string ``"1"``), NaN, a
            negative number (``-inf`` included), an infinity without ``allow_inf``, or an int too large for a
            float (``10**400``: refused rather than read as infinity, which ``math.inf`` spells explicitly).
    """
    return _check_real(name, value, unit="seconds", positive=False, allow_inf=allow_inf)


def check_positive(name: str, value: object, *, unit: str) -> float:
    """A finite real number > 0 a caller passes (a bandwidth, a hang horizon), as a Python float (R7).

    Args:
        name: the parameter's name, as the caller wrote it (used in the message).
        value: an int, a float, or a numpy integer or floating.
        unit: what the number counts, for the message (e.g. ``"bytes per second"``).

    Returns:
        ``value`` as a finite Python float > 0.

    Raises:
        InvalidTransferError: a bool, a non-number, NaN, zero or a negative number, an infinity, or an int too
            large for a float.
    """
    return _check_real(name, value, unit=unit, positive=True, allow_inf=False)


def check_job_ids(job_ids: object) -> set[int]:
    """The ids a ``wait`` lists: an iterable of job ids (R7).

    A job id is any int (see :func:`check_int`): it is only ever compared, hashed and printed (a tag, a set
    member), never converted to a fixed-width integer, so ids beyond the int64 range work as well as small ones.

    Args:
        job_ids: an iterable of ints (a set, a list, a generator).

    Returns:
        The ids, as a set of Python ints.

    Raises:
        InvalidTransferError: not an iterable (e.g. ``wait(8)``: pass ``wait({8})``), or an element that is not
            a job id.
    """
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise InvalidTransferError(f"job_ids must be an iterable of job ids (e.g. {{{_show(job_ids)}}}), "
                                   f"got {type(job_ids).__name__}")
    return {check_int("job_id", job) for job in job_ids}


def check_timeout(timeout: object) -> float | None:
    """A wait's timeout: None (no bound) or a real number of seconds >= 0 (R7); ``math.inf`` means no bound.

    A finite int too large for a float (``10**400``) is refused, not read as "no bound": such a number is almost
    certainly a mistake (a unit, an overflowed computation), and None and ``math.inf`` say "no bound" explicitly.
    A finite float, however large (``1e300``), is a bound like any other.

    Args:
        timeout: None, an int, a float, or a numpy integer or floating.

    Returns:
        None for no bound (None or ``math.inf``), else the timeout as a finite Python float >= 0.

    Raises:
        InvalidTransferError: a bool, a non-number (e.g. the string "1"), NaN, a negative number, or an int too
            large for a float; the message names ``timeout``.
    """
    if timeout is None:
        return None
    value = _check_real("timeout", timeout, unit="seconds", positive=False, allow_inf=True)
    return None if value == math.inf else value


def _int_tuple(values: object, name: str, minimum: int, maximum: int | None = None) -> tuple[int, ...]:
    """Return ``values`` as a tuple of ints in [``minimum``, ``maximum``], or raise InvalidTransferError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidTransferError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return tuple(check_int(f"{name}[{i}]", v, minimum=minimum, maximum=maximum) for i, v in enumerate(values))


def readonly(array: Int64Array) -> Int64Array:
    """Mark ``array`` read-only and return it."""
    array.setflags(write=False)
    return array


def _refuse_bools(values: object, name: str, noun: str) -> None:
    """Refuse a list or tuple of ids holding a bool: numpy would silently turn ``[True, 5]`` into ``[1, 5]``.

    Costs one C-level pass over the element types; nothing at all for a numpy array (its dtype says it).
    """
    if not isinstance(values, (list, tuple)):
        return
    if all(kind is int or issubclass(kind, np.integer) for kind in set(map(type, values))):
        return
    for pos, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, np.ndarray) and value.dtype.kind == "b"):
            raise InvalidTransferError(f"{name}[{pos}] = {value!r} is a bool: pass integer {noun}")


def check_id_array(name: str, values: object, *, noun: str = "ids") -> Int64Array:
    """Validate a 1-D list of ids >= 0 (R7) and return it as a read-only 1-D int64 copy.

    Args:
        name: the parameter's name, as the caller wrote it (used in the messages).
        values: a list or tuple of ints, a range, or an integer numpy array; an empty list is accepted.
        noun: what the ids are, for the bool message ("pass integer <noun>").

    Returns:
        The ids as a new read-only 1-D int64 array.

    Raises:
        InvalidTransferError: not 1-D, not an integer dtype (bool and float included), an id beyond the int64
            range, a bool among the ids (numpy would make ``[True, 5]`` into ``[1, 5]``), or a negative id.
    """
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidTransferError(f"{name} must be a 1-D sequence of ints: {exc}") from None
    if arr.ndim != 1:
        raise InvalidTransferError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "b":
        raise InvalidTransferError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.size == 0:
        return readonly(np.empty(0, dtype=np.int64))
    if arr.dtype.kind == "O":  # ints beyond the int64 range make an object array: say so
        big = next((v for v in arr.tolist() if isinstance(v, int) and not -INT64_MAX - 1 <= v <= INT64_MAX), None)
        if big is not None:
            raise InvalidTransferError(f"{name} must fit in int64, got {_show(big)}")
    if arr.dtype.kind not in "iu":  # float (an empty list is float64: accepted above), object, str
        raise InvalidTransferError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > INT64_MAX:
        raise InvalidTransferError(f"{name} must fit in int64, got {int(arr.max())}")
    _refuse_bools(values, name, noun)  # all bools gave a bool dtype above; bools mixed with ints give an int one
    ids = np.array(arr, dtype=np.int64)
    if int(ids.min()) < 0:
        pos = int(np.flatnonzero(ids < 0)[0])
        raise InvalidTransferError(f"{name}[{pos}] = {int(ids[pos])} is negative: expected >= 0")
    return readonly(ids)


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
        raise InvalidTransferError(f"{name} must be a LayerRef, got {type(ref).__name__}")
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
        raise InvalidTransferError(f"groups must be a sequence of sequences of LayerRef, "
                                   f"got {type(groups).__name__}")
    result: list[tuple[LayerRef, ...]] = []
    for g, refs in enumerate(groups):
        if isinstance(refs, (str, bytes)) or not isinstance(refs, Iterable):
            raise InvalidTransferError(f"groups[{g}] must be a sequence of LayerRef, got {type(refs).__name__}")
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
        pages = _int_tuple(tensor_page_bytes, "tensor_page_bytes", 1, INT64_MAX)  # the planner's int64 arrays
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
        sizes = _int_tuple(group_sizes, "GPULoadStoreSpec.group_sizes", 0)
        indices = _int_tuple(block_indices, "GPULoadStoreSpec.block_indices", 0)
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
                      bpc: int) -> tuple[Int64Array, Int64Array]:
    """Validate both sides' geometry and return their ``(4, n)`` columns (see :func:`_columns`)."""
    for side, geoms in (("GPU", gpu), ("CPU", cpu)):
        if not isinstance(geoms, Sequence):
            raise InvalidTransferError(f"{side} tensor geometries must be a sequence of TensorGeometry, "
                                       f"got {type(geoms).__name__}")
        if len(geoms) != layout.num_tensors:
            raise InvalidTransferError(f"got {len(geoms)} {side} tensor geometries, expected "
                                       f"{layout.num_tensors} (one per layout tensor)")
    pages = layout.tensor_page_bytes
    return (_columns(gpu, "gpu", pages, "tensor_page_bytes[{t}]"),
            _columns(cpu, "cpu", [p * bpc for p in pages], "tensor_page_bytes[{t}] * blocks_per_chunk"))


def check_geometry(layout: KVCacheLayout, gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry],
                   blocks_per_chunk: int) -> None:
    """Check that the GPU tensors and CPU views fit ``layout`` with ``blocks_per_chunk`` GPU pages per CPU row.

    Args:
        layout: the KV-cache layout.
        gpu: one geometry per layout tensor; row_bytes must equal ``tensor_page_bytes[t]``.
        cpu: one geometry per layout tensor; row_bytes must equal ``tensor_page_bytes[t] * blocks_per_chunk``.
        blocks_per_chunk: GPU pages per CPU row, >= 1.

    Raises:
        InvalidTransferError: counts differ from ``layout.num_tensors``, a row size differs from the layout, a
            row stride is smaller than its row, a tensor has no rows, or its addresses leave int64.
    """
    geometry_columns(layout, gpu, cpu, check_int("blocks_per_chunk", blocks_per_chunk, minimum=1))

