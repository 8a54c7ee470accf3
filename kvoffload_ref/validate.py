"""The package's one home for checking user-supplied numbers and ids (R7); pure, imports only ``errors``.

:func:`check_int` is the one integer validator of the package: a Python int or a numpy integer is accepted (and
returned as a Python int), a bool, float or string is refused with :class:`~kvoffload_ref.errors.InvalidTransferError`
naming the parameter. Every size, index and count a caller passes goes through it.

:func:`check_seconds` (a duration) and :func:`check_positive` (a rate, a horizon) are its counterparts for real
numbers, and :func:`check_timeout` for a wait's bound: each refuses a bool, a non-number, NaN, an out-of-range
value, an infinity where a finite value is meant and an int too large for a float (``10**400``: ``float()`` of it
overflows) *before* any arithmetic, and returns a Python float. Their messages never print an int of more than
128 bits in full (``str()`` of an int over 4300 digits raises).

:func:`check_job_ids` checks the ids a ``wait`` lists, and :func:`check_id_array` a 1-D list of ids >= 0 (the
specs' block ids, the sim's descriptor ids): no negative id, no bool (``[True, 5]`` is refused even though numpy
would silently make it ``[1, 5]``), returned as a read-only int64 copy.

:func:`check_sizes` and :func:`check_views` check a host region's sizes and the CPU tensors it is asked to
lay out (every view inside the mapping) before anything is mapped.

:mod:`kvoffload_ref.specs` re-exports the public validators, so ``from kvoffload_ref.specs import check_int``
keeps working.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.errors import InvalidTransferError

__all__ = [
    "INT64_MAX",
    "ByteArray",
    "Int64Array",
    "check_id_array",
    "check_int",
    "check_int_tuple",
    "check_job_ids",
    "check_positive",
    "check_seconds",
    "check_sizes",
    "check_timeout",
    "check_views",
    "map_refused",
    "readonly",
    "short_repr",
]

Int64Array = npt.NDArray[np.int64]  # an array of int64 ids or sizes
ByteArray = npt.NDArray[np.uint8]  # bytes: a region row, a snapshot

INT64_MAX: Final = 2**63 - 1


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


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters (with its full length) when longer; an int of
    more than 128 bits is named by its size.

    Args:
        value: what the caller passed.
        limit: the most characters shown.

    Returns:
        The text to show.
    """
    text = _show(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value  # the common case: a plain int in range (every submission and wait comes through here)
    # R7: every refusal names the field, the value and a valid example (the bound nearest zero).
    example = f" (e.g. {minimum if minimum is not None else 0 if maximum is None or maximum >= 0 else maximum})"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTransferError(f"{name} must be an int, got {type(value).__name__} {_show(value)}{example}")
    result = int(value)
    if (minimum is not None and result < minimum) or (maximum is not None and result > maximum):
        if maximum is None:
            raise InvalidTransferError(f"{name} must be >= {minimum}, got {_show(result)}{example}")
        if minimum is None:
            raise InvalidTransferError(f"{name} must be <= {maximum}, got {_show(result)}{example}")
        raise InvalidTransferError(f"{name} must be an int in [{minimum}, {maximum}], got {_show(result)}{example}")
    return result


def check_int_tuple(name: str, values: object, *, minimum: int, maximum: int | None = None) -> tuple[int, ...]:
    """R7: ``values`` (any iterable but a string) as a tuple of ints in [``minimum``, ``maximum``].

    Raises:
        InvalidTransferError: not an iterable of ints, or an entry out of range (named ``name[i]``).
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidTransferError(f"{name} must be a sequence of ints (e.g. ({max(minimum, 1)},)), got "
                                   f"{type(values).__name__} {_show(values)}")
    return tuple(check_int(f"{name}[{i}]", v, minimum=minimum, maximum=maximum) for i, v in enumerate(values))


def _check_real(name: str, value: object, *, unit: str, positive: bool, allow_inf: bool) -> float:
    """The real-number validator behind :func:`check_seconds`, :func:`check_positive` and :func:`check_timeout`.

    Returns ``value`` as a Python float (``math.inf`` only with ``allow_inf``); every check runs before any
    arithmetic on the value. See :func:`check_seconds` for what is refused.
    """
    if type(value) is float and (value > 0.0 if positive else value >= 0.0) and value < math.inf:
        return value  # the common case, in one comparison chain (sleep() and every wait come through here)
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, _REAL):
        raise InvalidTransferError(f"{name} must be a number of {unit} {bound} (an int or a float, e.g. 1.0), "
                                   f"got {type(value).__name__} {_show(value)}")
    if isinstance(value, (int, np.integer)):
        exact = int(value)
        if exact < 0 or (positive and exact == 0):
            what = "negative" if exact < 0 else "zero"
            raise InvalidTransferError(f"{name} = {_show(exact)} is {what}: expected a number of {unit} {bound} "
                                           "(e.g. 1.0)")
        try:
            return float(exact)
        except OverflowError:
            raise InvalidTransferError(
                f"{name} = {_show(exact)} is too large: it does not fit in a float (at most "
                f"{sys.float_info.max:.4g} {unit})" + ("; pass math.inf for no bound" if allow_inf else "")
            ) from None
    number = float(value)  # a float or a numpy floating (a long double beyond the float range becomes inf)
    if math.isnan(number):
        raise InvalidTransferError(f"{name} is NaN: expected a number of {unit} {bound} (e.g. 1.0)")
    if number < 0 or (positive and number == 0):
        what = "negative" if number < 0 else "zero"
        raise InvalidTransferError(f"{name} = {_show(value)} is {what}: expected a number of {unit} {bound} "
                                   "(e.g. 1.0)")
    if math.isinf(number):
        if not np.isinf(value):  # a numpy floating beyond the float range (a long double)
            raise InvalidTransferError(f"{name} = {_show(value)} is too large: it does not fit in a float (at most "
                                       f"{sys.float_info.max:.4g} {unit})")
        if not allow_inf:
            raise InvalidTransferError(f"{name} is infinite: expected a finite number of {unit} {bound} "
                                       "(e.g. 1.0)")
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


#: Iterables a wait usually lists its ids in: known iterable at once (the ABC check costs a microsecond).
_ID_CONTAINERS: Final = frozenset({list, tuple, set, frozenset, range})


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
    if type(job_ids) in _ID_CONTAINERS:
        listed: Iterable[int] = job_ids  # type: ignore[assignment]  # a known iterable (its elements: tested next)
        for job in listed:
            if type(job) is not int:
                break
        else:  # plain ints alone (a wait's usual list): each is what check_int returns for it
            return set(listed)
    elif isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        # Invariant: the example is valid itself: ``{8}`` for ``wait(8)``, a set of ints for anything else.
        example = (f"{{{_show(job_ids)}}}" if isinstance(job_ids, (int, np.integer)) and not isinstance(job_ids, bool)
                   else "{3} or [3, 4]")
        raise InvalidTransferError(f"job_ids must be an iterable of job ids (e.g. {example}), "
                                   f"got {type(job_ids).__name__} {_show(job_ids)}")
    ids: Iterable[object] = job_ids  # type: ignore[assignment]  # an iterable (checked above; no cast: a cast
    # of a subscripted generic builds the alias on every call)
    return {check_int("job_id", job) for job in ids}


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
    if isinstance(values, Iterator):  # a generator or map: numpy would make it a 0-d object array, "shape ()"
        raise InvalidTransferError(f"{name} must be a list, tuple, range or integer numpy array of ids (e.g. "
                                   f"[0, 1, 2]), got a {type(values).__name__}: pass list(...) of it")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidTransferError(f"{name} must be a 1-D sequence of ints (e.g. [0, 1, 2]): {exc}") from None
    if arr.ndim != 1:
        raise InvalidTransferError(f"{name} must be 1-D (e.g. [0, 1, 2]), got {type(values).__name__} of shape "
                                   f"{arr.shape}")
    if arr.dtype.kind == "b":
        raise InvalidTransferError(f"{name} must have an integer dtype (e.g. [0, 1, 2]), got {arr.dtype}")
    if arr.size == 0:
        return readonly(np.empty(0, dtype=np.int64))
    if arr.dtype.kind == "O":  # ints beyond the int64 range make an object array: say so
        big = next((v for v in arr.tolist() if isinstance(v, int) and not -INT64_MAX - 1 <= v <= INT64_MAX), None)
        if big is not None:
            raise InvalidTransferError(f"{name} must fit in int64, got {_show(big)}")
    if arr.dtype.kind not in "iu":  # float (an empty list is float64: accepted above), object, str
        raise InvalidTransferError(f"{name} must have an integer dtype (e.g. [0, 1, 2]), got {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > INT64_MAX:
        raise InvalidTransferError(f"{name} must fit in int64, got {int(arr.max())}")
    _refuse_bools(values, name, noun)  # all bools gave a bool dtype above; bools mixed with ints give an int one
    ids = np.array(arr, dtype=np.int64)
    if int(ids.min()) < 0:
        pos = int(np.flatnonzero(ids < 0)[0])
        raise InvalidTransferError(f"{name}[{pos}] = {int(ids[pos])} is negative: expected >= 0")
    return readonly(ids)


def check_sizes(blocks_per_chunk: object, num_cpu_chunks: object) -> tuple[int, int]:
    """Refuse non-int or non-positive region sizes (R7); numpy integers are ints here, as everywhere.

    Returns:
        ``(blocks_per_chunk, num_cpu_chunks)`` as Python ints.

    Raises:
        InvalidTransferError: ``blocks_per_chunk`` or ``num_cpu_chunks`` is not an int in [1, 2**63 - 1] (see
            ``check_int``).
    """
    return (check_int("blocks_per_chunk", blocks_per_chunk, minimum=1, maximum=INT64_MAX),
            check_int("num_cpu_chunks", num_cpu_chunks, minimum=1, maximum=INT64_MAX))


def _int_list(name: str, values: object, minimum: int) -> list[int]:
    """``values`` as a list of ints in [``minimum``, 2**63 - 1] (R7)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidTransferError(f"{name} must be a sequence of ints (e.g. [{max(minimum, 0)}]), got "
                                   f"{type(values).__name__} {_show(values)}")
    return [check_int(f"{name}[{i}]", v, minimum=minimum, maximum=INT64_MAX) for i, v in enumerate(values)]


def check_views(nbytes: int, offsets: object, row_bytes: object, num_cpu_chunks: object,
                row_strides: object) -> tuple[list[int], list[int], int, list[int]]:
    """Check that the CPU tensors a region is asked to make lie inside its mapping of ``nbytes`` bytes (R7).

    A view that ran past the mapping would be a window onto memory the region does not own, so this runs before
    any view is made.

    Args:
        nbytes: the mapping's size.
        offsets: per tensor, the byte offset of row 0 (ints >= 0).
        row_bytes: per tensor, the bytes of one row (ints >= 1).
        num_cpu_chunks: rows per tensor (an int >= 1).
        row_strides: per tensor, the bytes between rows (ints >= that tensor's row bytes), or None (contiguous).

    Returns:
        ``(offsets, row_bytes, num_cpu_chunks, row_strides)`` as Python ints.

    Raises:
        InvalidTransferError: a value that is not an int in range, lists of different lengths, a stride smaller
            than its row, or a tensor whose last row ends beyond the mapping.
    """
    rows = check_int("num_cpu_chunks", num_cpu_chunks, minimum=1, maximum=INT64_MAX)
    offs = _int_list("offsets", offsets, 0)
    sizes = _int_list("row_bytes", row_bytes, 1)
    strides = list(sizes) if row_strides is None else _int_list("row_strides", row_strides, 1)
    if not len(offs) == len(sizes) == len(strides):
        raise InvalidTransferError(f"offsets, row_bytes and row_strides must be as long as one another (one entry "
                                   f"per tensor), got {len(offs)}, {len(sizes)} and {len(strides)}")
    for t, (off, size, stride) in enumerate(zip(offs, sizes, strides, strict=True)):
        if stride < size:
            raise InvalidTransferError(f"row_strides[{t}] = {stride} is smaller than its row: expected >= "
                                       f"row_bytes[{t}] = {size}")
        end = off + (rows - 1) * stride + size
        if end > nbytes:
            raise InvalidTransferError(f"tensor {t} ends at byte {end}, beyond the mapping of {nbytes} bytes")
    return offs, sizes, rows, strides


def map_refused(exc: OSError, total: int, num_cpu_chunks: int, blocks_per_chunk: int) -> str:
    """The message of a host region the system would not map (R7): its size, the fields that made it, an example.

    Args:
        exc: what ``mmap`` raised.
        total: the bytes asked for.
        num_cpu_chunks: the field that sized it.
        blocks_per_chunk: the other one.

    Returns:
        One line naming ``num_cpu_chunks``, its value, the size, and a value that maps at most 1 GiB.
    """
    per_chunk = max(1, total // num_cpu_chunks)
    fits = max(1, (1 << 30) // per_chunk)  # an example that maps 1 GiB at most
    return (f"cannot map a host region of {total} bytes ({total / 2**30:.1f} GiB) for num_cpu_chunks="
            f"{num_cpu_chunks} with blocks_per_chunk={blocks_per_chunk} (about {per_chunk} bytes per chunk): "
            f"{exc.strerror or exc}; pass fewer chunks (e.g. num_cpu_chunks={fits}, about "
            f"{fits * per_chunk} bytes)")
