"""The derivation of canonical page mappings (R24): from a rank's parallel context and a layer's geometry to the
rank's :class:`~kvoffload_ref.canonical.PageMapping`, pure (imports only the mapping model, errors, validate).

Theory of operation
-------------------
This is the one place that reasons about parallelism (vLLM #48408). A rank of the offload group is described by
a :class:`ParallelContext`: tensor parallelism ``tp``, decode and prefill context parallelism ``dcp`` and
``pcp``, the context-parallel interleave ``I`` (tokens per chunk dealt to a CP rank), and its ``rank``. Then
``tp_rank = rank % tp``, ``pcp_rank = rank // tp``, ``cp = dcp * pcp`` and the rank's CP position is
``pcp_rank * dcp + tp_rank % dcp``. A layer is described by a :class:`LayerGeometry`: split KV (a K half then a
V half, ``(blocks, 2, block_size, heads, head_size)``) or packed KV (K|V adjacent per head and token,
``(blocks, heads, block_size, 2 * head_size)``), token-major (NHD) or head-major (HND); MLA (one latent row per
token, replicated across TP); or another kind of layer (a page of opaque bytes).

The canonical page of a layer holds all ``H`` KV heads and ``span = block_size * cp`` tokens. :func:`certify`
checks the gates in order and refuses (:class:`UncertifiedLayoutError`, naming the gate) what it cannot
certify:

* ``world``: the group is not exactly the TP x PCP grid (``world_size != tp * pcp``). Canonical mode is refused
  outright: no fallback either (vLLM derives no mapping at all then).
* ``attention``: the layer is not an attention layer.
* ``interleave``: with ``cp > 1``, ``I > block_size`` or ``block_size % I != 0``.
* MLA: ``compress_ratio`` (must be 1), ``mla_page`` (the page must split into ``block_size`` equal token rows),
  ``mla_dcp`` (``tp % dcp == 0``), ``quantization`` (no per-token-head quantisation).
* Attention: ``quantization``; ``local_heads`` (the rank holds ``max(1, H // tp)`` heads); ``head_split``
  (``H % tp == 0``, giving ``tp`` head shards; or, with more ranks than heads, ``tp % H == 0``, giving ``H``
  shards each replicated ``tp / H`` times); ``replication_dcp`` (the replication is a multiple of ``dcp``:
  DCP splits tokens among ranks that hold the same heads); ``page_size`` (the declared page is the dense page of
  the dimensions); ``strides`` (the strides are a dense NHD or HND layout, the declared one); ``ambiguous``
  (the ROCm AITER split layout with its heads flattened, at two local heads indistinguishable from packed KV).

Certified, a page becomes byte regions that repeat once per token (per half for split NHD, per half and local
head for split HND, one for packed NHD, per local head for packed HND, one whole token row for MLA), placed at the
rank's head shard ``tp_rank // replication``. Token placement: without CP each region is one run of
``block_size`` fragments; with CP, local token ``l`` lands at canonical token ``((l // I) * cp + c) * I + l % I``
(``c`` the CP position), one run per chunk of ``I`` tokens. Contiguous runs are then coalesced (a single rank's
mapping becomes one whole-page run). Writers: ``replication / dcp`` of them (MLA: ``tp / dcp``), this rank's
index ``(tp_rank % replication) // dcp`` (MLA: ``tp_rank // dcp``). The canonical page is ``cp * shards *
local page`` (MLA: ``cp * local page``); the mapping is parallelism-agnostic when ``cp == 1``.

:func:`derive_mapping` and :func:`derive_layer` fail closed: a layer that does not pass the gates gets the
*opaque* fallback (:func:`opaque_mapping`), the rank's whole page at ``rank * page`` of a canonical page of
``world * page`` bytes, one writer, not parallelism-agnostic. :func:`derive_layer` derives every rank of the
group (all certified, or all opaque) and verifies the result (R24) before returning it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

from kvoffload_ref.canonical import ByteRun, KVOrder, PageMapping, canonical_format_id, verify_mappings
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.validate import INT64_MAX, check_int, check_int_tuple

__all__ = [
    "Gate",
    "LayerKind",
    "LayerGeometry",
    "ParallelContext",
    "UncertifiedLayoutError",
    "certify",
    "derive_layer",
    "derive_mapping",
    "opaque_mapping",
]

#: What a layer is: split or packed attention KV, an MLA latent, or another kind of layer (opaque bytes).
LayerKind = Literal["split", "packed", "mla", "other"]

#: The gate a layout failed (see the module's docstring).
Gate = Literal["world", "attention", "interleave", "compress_ratio", "mla_page", "mla_dcp", "quantization",
               "local_heads", "head_split", "replication_dcp", "page_size", "strides", "ambiguous"]

_KINDS = ("split", "packed", "mla", "other")


class UncertifiedLayoutError(InvalidTransferError):
    """The derivation cannot certify a canonical mapping for this layer and rank (it fails closed).

    Attributes:
        gate: the gate that failed (:data:`Gate`).
    """

    def __init__(self, gate: Gate, message: str) -> None:
        super().__init__(f"cannot certify a canonical mapping ({gate}): {message}")
        self.gate: Gate = gate

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_uncertified, (self.gate, str(self)))


def _rebuild_uncertified(gate: Gate, text: str) -> UncertifiedLayoutError:
    error = UncertifiedLayoutError(gate, "")
    error.args = (text,)
    return error


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """One rank of the offload group: its parallel configuration and its rank.

    Raises:
        InvalidTransferError: a size is not an int in ``[1, 2**20]`` (``world_size``: ``[1, 2**40]``), or ``rank``
            is not in ``[0, world)``.
    """

    tp: int  # Invariant: >= 1 (tensor-parallel size).
    dcp: int = 1  # Invariant: >= 1 (decode context-parallel size, within the TP group).
    pcp: int = 1  # Invariant: >= 1 (prefill context-parallel size, across TP groups).
    interleave: int = 1  # Invariant: >= 1 (tokens per chunk dealt to one CP rank).
    rank: int = 0  # Invariant: 0 <= rank < world.
    world_size: int | None = None  # Invariant: None (the grid, tp * pcp) or >= 1; != tp * pcp fails the gate.

    def __post_init__(self) -> None:
        for name in ("tp", "dcp", "pcp", "interleave"):
            object.__setattr__(self, name, check_int(f"ParallelContext.{name}", getattr(self, name), minimum=1,
                                                     maximum=1 << 20))
        if self.world_size is not None:
            object.__setattr__(self, "world_size", check_int("ParallelContext.world_size", self.world_size,
                                                             minimum=1, maximum=1 << 40))
        object.__setattr__(self, "rank", check_int("ParallelContext.rank", self.rank, minimum=0,
                                                   maximum=self.world - 1))

    @property
    def world(self) -> int:
        """The ranks of the worker group: ``world_size``, or ``tp * pcp`` when not given."""
        return self.group_size if self.world_size is None else self.world_size

    @property
    def group_size(self) -> int:
        """The ranks of the TP x PCP grid: ``tp * pcp``."""
        return self.tp * self.pcp

    @property
    def tp_rank(self) -> int:
        """The rank within its TP group: ``rank % tp``."""
        return self.rank % self.tp

    @property
    def pcp_rank(self) -> int:
        """The rank's PCP group: ``rank // tp``."""
        return self.rank // self.tp

    @property
    def cp(self) -> int:
        """Context-parallel ranks a block's tokens are dealt to: ``dcp * pcp``."""
        return self.dcp * self.pcp

    @property
    def cp_rank(self) -> int:
        """The rank's position among the CP ranks: ``pcp_rank * dcp + tp_rank % dcp``."""
        return self.pcp_rank * self.dcp + self.tp_rank % self.dcp

    def with_rank(self, rank: int) -> ParallelContext:
        """The same configuration, seen from ``rank``."""
        return dataclasses.replace(self, rank=rank)


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidTransferError(f"LayerGeometry.{name} must be a bool, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """One layer's page as the derivation sees it (the same on every rank of the group).

    Attributes:
        kind: ``"split"``, ``"packed"``, ``"mla"`` or ``"other"`` (:data:`LayerKind`).
        block_size: tokens per block on this rank (``bs``).
        element_size: bytes per element (``e``).
        head_size: elements per head (``d``); split and packed KV only.
        total_kv_heads: KV heads of the whole model (``H``); split and packed KV only.
        local_kv_heads: KV heads this rank's page holds (``h``); split and packed KV only.
        latent_size: elements of the MLA latent per token; MLA only (or give ``page_bytes``).
        order: the worker's layout family, ``"NHD"`` or ``"HND"``; it also names the format id.
        page_bytes: the unpadded page in bytes; None: the dense page of the dimensions. Required for ``"other"``.
        strides: the KV tensor's strides in elements, block dimension first (5 for split KV, 4 for packed or
            for split with flattened heads); None: the dense strides of ``order``.
        compress_ratio: MLA's token compression (only 1 is certified).
        per_token_head_quant: the cache is quantised per token and head (never certified).
        heads_flattened: split KV as ROCm AITER lays it out, ``(blocks, 2, block_size, heads * head_size)``.

    Raises:
        InvalidTransferError: a field has the wrong type or is out of range, a field is missing for the kind,
            or ``heads_flattened`` is set on a layer that is not split KV.
    """

    kind: LayerKind  # Invariant: one of _KINDS.
    block_size: int  # Invariant: >= 1.
    element_size: int  # Invariant: >= 1.
    head_size: int = 0  # Invariant: >= 1 for split and packed KV.
    total_kv_heads: int = 1  # Invariant: >= 1.
    local_kv_heads: int = 1  # Invariant: >= 1.
    latent_size: int = 0  # Invariant: >= 0; >= 1 for MLA unless page_bytes is given.
    order: KVOrder = "NHD"  # Invariant: "NHD" or "HND".
    page_bytes: int | None = None  # Invariant: None or >= 1; not None for "other".
    strides: tuple[int, ...] | None = None  # Invariant: None or a tuple of ints >= 0 (a list is accepted).
    compress_ratio: int = 1  # Invariant: >= 1.
    per_token_head_quant: bool = False
    heads_flattened: bool = False  # Invariant: only on split KV.

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidTransferError(f"LayerGeometry.kind must be one of {_KINDS}, got {self.kind!r}")
        canonical_format_id(self.order)  # refuses an unknown order
        attention = self.kind in ("split", "packed")
        for name, minimum in (("block_size", 1), ("element_size", 1), ("head_size", 1 if attention else 0),
                              ("total_kv_heads", 1), ("local_kv_heads", 1), ("latent_size", 0),
                              ("compress_ratio", 1)):
            object.__setattr__(self, name, check_int(f"LayerGeometry.{name}", getattr(self, name),
                                                     minimum=minimum, maximum=1 << 30))
        if self.page_bytes is not None:
            object.__setattr__(self, "page_bytes", check_int("LayerGeometry.page_bytes", self.page_bytes,
                                                             minimum=1, maximum=INT64_MAX))
        elif self.kind == "other" or (self.kind == "mla" and self.latent_size == 0):
            raise InvalidTransferError(f"LayerGeometry of kind {self.kind!r} needs page_bytes"
                                       + (" or latent_size" if self.kind == "mla" else ""))
        _check_flag("per_token_head_quant", self.per_token_head_quant)
        if _check_flag("heads_flattened", self.heads_flattened) and self.kind != "split":
            raise InvalidTransferError("LayerGeometry.heads_flattened applies to split KV only")
        if self.strides is not None:
            object.__setattr__(self, "strides", check_int_tuple("LayerGeometry.strides", self.strides, minimum=0,
                                                                maximum=INT64_MAX))

    def dense_page_size(self) -> int:
        """The page the dimensions give: ``2 * bs * h * d * e`` for KV, ``bs * latent * e`` for MLA, else the
        declared page."""
        if self.kind in ("split", "packed"):
            return 2 * self.block_size * self.local_kv_heads * self.head_size * self.element_size
        if self.kind == "mla" and self.latent_size:
            return self.block_size * self.latent_size * self.element_size
        assert self.page_bytes is not None  # Invariant of "other" and of MLA without latent_size
        return self.page_bytes

    @property
    def local_page_size(self) -> int:
        """The unpadded page in bytes: ``page_bytes`` when given, else :meth:`dense_page_size`."""
        return self.dense_page_size() if self.page_bytes is None else self.page_bytes

    def dense_strides(self, order: KVOrder | None = None) -> tuple[int, ...]:
        """The element strides of a dense tensor of this geometry in ``order`` (default: the declared order).

        Returns:
            5 strides for split KV, 4 for packed KV and for split KV with flattened heads; () for other kinds.
        """
        order = self.order if order is None else order
        bs, h, d = self.block_size, self.local_kv_heads, self.head_size
        block = 2 * bs * h * d
        if self.kind == "split" and self.heads_flattened:
            return (block, bs * h * d, h * d, 1)
        if self.kind == "split":
            return (block, bs * h * d, h * d, d, 1) if order == "NHD" else (block, bs * h * d, d, bs * d, 1)
        if self.kind == "packed":
            return (block, 2 * d, h * 2 * d, 1) if order == "NHD" else (block, bs * 2 * d, 2 * d, 1)
        return ()


class _Region(NamedTuple):
    """Bytes of a page that repeat once per token: where they start on each side and their token stride."""

    local_offset: int
    canonical_offset: int
    bytes_per_token: int
    canonical_token_stride: int


def opaque_mapping(local_page_size: int, num_ranks: int, rank: int, *, order: KVOrder = "NHD",
                   reason: str = "not certified") -> PageMapping:
    """The fallback for a layer the derivation cannot certify: the rank's page whole, at a rank-exclusive offset.

    Args:
        local_page_size: the rank's unpadded page in bytes.
        num_ranks: ranks of the group (the canonical page holds one page per rank).
        rank: this rank, in ``[0, num_ranks)``.
        order: the layout family (names the format id).
        reason: why the derivation fell back (kept in ``fallback_reason``).

    Returns:
        One run ``(0, rank * page, page, 1, page, page)`` in a canonical page of ``num_ranks * page`` bytes,
        one writer, not parallelism-agnostic, opaque.

    Raises:
        InvalidTransferError: a size is not an int >= 1, or ``rank`` is not in ``[0, num_ranks)``.
    """
    page = check_int("local_page_size", local_page_size, minimum=1, maximum=INT64_MAX)
    ranks = check_int("num_ranks", num_ranks, minimum=1, maximum=INT64_MAX // page)
    rank = check_int("rank", rank, minimum=0, maximum=ranks - 1)
    return PageMapping(ranks * page, page, (ByteRun(0, rank * page, page, 1, page, page),), 1, 0,
                       parallelism_agnostic=False, format_id=canonical_format_id(order), opaque=True,
                       fallback_reason=reason or "not certified")


def _check_inputs(ctx: object, geometry: object) -> tuple[ParallelContext, LayerGeometry]:
    if not isinstance(ctx, ParallelContext):
        raise InvalidTransferError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
    if not isinstance(geometry, LayerGeometry):
        raise InvalidTransferError(f"geometry must be a LayerGeometry, got {type(geometry).__name__}")
    if ctx.world != ctx.group_size:
        raise UncertifiedLayoutError("world", f"the worker group has {ctx.world} ranks, not the TP x PCP grid's "
                                              f"tp * pcp = {ctx.group_size}")
    return ctx, geometry


def _head_sharding(ctx: ParallelContext, g: LayerGeometry) -> tuple[int, int]:
    """(head shards, replication) of an attention layer, or the gate it fails."""
    total, tp = g.total_kv_heads, ctx.tp
    if g.local_kv_heads != max(1, total // tp):
        raise UncertifiedLayoutError("local_heads", f"the page holds {g.local_kv_heads} KV heads, expected "
                                                    f"max(1, {total} // {tp}) = {max(1, total // tp)}")
    if total >= tp and total % tp:
        raise UncertifiedLayoutError("head_split", f"{total} KV heads do not split evenly over tp = {tp}")
    if total < tp and tp % total:
        raise UncertifiedLayoutError("head_split", f"tp = {tp} is not a multiple of the {total} KV heads")
    shards, replication = (tp, 1) if total >= tp else (total, tp // total)
    if replication % ctx.dcp:
        raise UncertifiedLayoutError("replication_dcp", f"each head is replicated {replication} times, not a "
                                                        f"multiple of dcp = {ctx.dcp}")
    return shards, replication


def _recognise(g: LayerGeometry) -> KVOrder:
    """The layout order the strides show (the declared one when both fit), or the gate it fails."""
    if g.heads_flattened and g.local_kv_heads == 2:
        raise UncertifiedLayoutError("ambiguous", "split KV with two flattened heads has the shape and strides "
                                                  "of packed KV")
    if g.local_page_size != g.dense_page_size():
        raise UncertifiedLayoutError("page_size", f"the page is {g.local_page_size} bytes, not the dense "
                                                  f"{g.dense_page_size()} of the dimensions")
    strides = g.dense_strides() if g.strides is None else g.strides
    if g.heads_flattened:
        if len(strides) != 4 or strides[3] != 1:
            raise UncertifiedLayoutError("strides", f"strides {strides} are not a flattened split KV layout")
        strides = (*strides[:3], g.head_size, 1)  # the heads unflattened out of the content dimension
    fits = [order for order in (g.order, "HND" if g.order == "NHD" else "NHD")
            if _fits(g, strides, order)]
    if not fits or fits[0] != g.order:
        shown = f"a dense {fits[0]} layout" if fits else "no dense NHD or HND layout"
        raise UncertifiedLayoutError("strides", f"strides {strides} show {shown}; the layout family is {g.order}")
    return g.order


def _fits(g: LayerGeometry, strides: tuple[int, ...], order: KVOrder) -> bool:
    """Whether ``strides`` (block stride aside, which may carry padding) are a dense ``order`` layout of ``g``."""
    bs, h, d = g.block_size, g.local_kv_heads, g.head_size
    if g.kind == "split":
        if len(strides) != 5 or strides[4] != 1 or strides[1] != bs * h * d:
            return False
        _, _, token, head, _ = strides
        return (token, head) == ((h * d, d) if order == "NHD" else (d, bs * d))
    if len(strides) != 4 or strides[3] != 1:
        return False
    _, head, token, _ = strides
    return (head, token) == ((2 * d, h * 2 * d) if order == "NHD" else (bs * 2 * d, 2 * d))


def _kv_regions(g: LayerGeometry, head_shard: int, shards: int, span: int) -> list[_Region]:
    """The byte regions of a split or packed KV page, this rank's heads at ``head_shard`` of ``shards``."""
    bs, h, e = g.block_size, g.local_kv_heads, g.element_size
    head_bytes = (g.head_size if g.kind == "split" else 2 * g.head_size) * e
    row = h * head_bytes  # bytes of one token's local heads (of one half, for split KV)
    halves = (0, 1) if g.kind == "split" else (0,)
    if g.order == "NHD":
        return [_Region(half * bs * row, half * span * shards * row + head_shard * row, row, shards * row)
                for half in halves]
    return [_Region(half * bs * row + j * bs * head_bytes,
                    (half * shards * h + head_shard * h + j) * span * head_bytes, head_bytes, head_bytes)
            for half in halves for j in range(h)]


def _place_tokens(regions: list[_Region], block_size: int, ctx: ParallelContext) -> list[ByteRun]:
    """Each region's tokens at their canonical positions: one run per region, or per interleave chunk with CP."""
    if ctx.cp == 1:
        return [ByteRun(r.local_offset, r.canonical_offset, r.bytes_per_token, block_size, r.bytes_per_token,
                        r.canonical_token_stride) for r in regions]
    runs = []
    step = ctx.interleave
    for r in regions:
        for first in range(0, block_size, step):
            token = ((first // step) * ctx.cp + ctx.cp_rank) * step  # the canonical position of local token first
            runs.append(ByteRun(r.local_offset + first * r.bytes_per_token,
                                r.canonical_offset + token * r.canonical_token_stride, r.bytes_per_token, step,
                                r.bytes_per_token, r.canonical_token_stride))
    return runs


def _coalesce(runs: list[ByteRun]) -> tuple[ByteRun, ...]:
    """Fewer copies for the same bytes: a run dense on both sides becomes one fragment, and consecutive
    one-fragment runs that continue each other on both sides become one."""
    out: list[ByteRun] = []
    for raw in runs:
        dense = raw.num_fragments > 1 and raw.local_stride == raw.canonical_stride == raw.fragment_size
        run = ByteRun(raw.local_offset, raw.canonical_offset, raw.nbytes, 1, raw.nbytes, raw.nbytes) if dense else raw
        last = out[-1] if out else None
        if (last is not None and last.num_fragments == run.num_fragments == 1
                and last.local_offset + last.fragment_size == run.local_offset
                and last.canonical_offset + last.fragment_size == run.canonical_offset):
            size = last.fragment_size + run.fragment_size
            out[-1] = ByteRun(last.local_offset, last.canonical_offset, size, 1, size, size)
        else:
            out.append(run)
    return tuple(out)


def certify(ctx: ParallelContext, geometry: LayerGeometry) -> PageMapping:
    """The certified canonical mapping of one layer at one rank, or a refusal naming the failed gate (R24).

    Args:
        ctx: the rank's parallel context.
        geometry: the layer's geometry.

    Returns:
        The rank's mapping: its runs, the canonical page size, the writer count and index, the flags and the
        format id (never opaque).

    Raises:
        UncertifiedLayoutError: a gate fails; ``.gate`` names it (see the module's docstring).
        InvalidTransferError: ``ctx`` or ``geometry`` has the wrong type.
    """
    ctx, g = _check_inputs(ctx, geometry)
    bs, page = g.block_size, g.local_page_size
    if g.kind == "other":
        raise UncertifiedLayoutError("attention", "only attention layers (KV or MLA) have a canonical form")
    if ctx.cp > 1 and (ctx.interleave > bs or bs % ctx.interleave):
        raise UncertifiedLayoutError("interleave", f"with context parallelism the interleave {ctx.interleave} "
                                                   f"must divide the block size {bs}")
    if g.kind == "mla":
        if g.compress_ratio != 1:
            raise UncertifiedLayoutError("compress_ratio", f"compress_ratio = {g.compress_ratio}, expected 1")
        if page % bs:
            raise UncertifiedLayoutError("mla_page", f"the {page}-byte page is not {bs} equal token rows")
        if ctx.tp % ctx.dcp:
            raise UncertifiedLayoutError("mla_dcp", f"tp = {ctx.tp} is not a multiple of dcp = {ctx.dcp}")
        if g.per_token_head_quant:
            raise UncertifiedLayoutError("quantization", "per-token-head quantisation is not certified")
        runs = _place_tokens([_Region(0, 0, page // bs, page // bs)], bs, ctx)
        return PageMapping(ctx.cp * page, page, _coalesce(runs), ctx.tp // ctx.dcp, ctx.tp_rank // ctx.dcp,
                           parallelism_agnostic=ctx.cp == 1, format_id=canonical_format_id(g.order))
    if g.per_token_head_quant:
        raise UncertifiedLayoutError("quantization", "per-token-head quantisation is not certified")
    shards, replication = _head_sharding(ctx, g)
    _recognise(g)
    regions = _kv_regions(g, ctx.tp_rank // replication, shards, bs * ctx.cp)
    return PageMapping(ctx.cp * shards * page, page, _coalesce(_place_tokens(regions, bs, ctx)),
                       replication // ctx.dcp, (ctx.tp_rank % replication) // ctx.dcp,
                       parallelism_agnostic=ctx.cp == 1, format_id=canonical_format_id(g.order))


def derive_mapping(ctx: ParallelContext, geometry: LayerGeometry) -> PageMapping:
    """One rank's mapping of one layer, failing closed: :func:`certify`'s, or the opaque fallback.

    The gates depend on the configuration and the geometry only, never on the rank, so every rank of a group
    falls back together.

    Args:
        ctx: the rank's parallel context.
        geometry: the layer's geometry.

    Returns:
        The certified mapping, or :func:`opaque_mapping` of the local page with the refusal as its reason.

    Raises:
        UncertifiedLayoutError: the ``world`` gate: the group is not the TP x PCP grid (no fallback then).
        InvalidTransferError: ``ctx`` or ``geometry`` has the wrong type.
    """
    ctx, geometry = _check_inputs(ctx, geometry)
    try:
        return certify(ctx, geometry)
    except UncertifiedLayoutError as refusal:
        return opaque_mapping(geometry.local_page_size, ctx.group_size, ctx.rank, order=geometry.order,
                              reason=str(refusal))


def derive_layer(layer: str, ctx: ParallelContext, geometry: LayerGeometry) -> tuple[PageMapping, ...]:
    """Every rank's mapping of one layer, verified (R24): all certified, or all opaque.

    Args:
        layer: the layer's name (for a verification failure's message).
        ctx: the group's parallel context (its ``rank`` is ignored).
        geometry: the layer's geometry (the same on every rank).

    Returns:
        One mapping per rank of the group, rank ``r`` at index ``r``.

    Raises:
        UncertifiedLayoutError: the ``world`` gate (canonical mode is refused).
        MappingError: the mappings do not verify (a bug in the derivation; never expected).
        InvalidTransferError: an argument has the wrong type.
    """
    ctx, geometry = _check_inputs(ctx, geometry)
    try:
        mappings = tuple(certify(ctx.with_rank(r), geometry) for r in range(ctx.group_size))
    except UncertifiedLayoutError as refusal:
        mappings = tuple(opaque_mapping(geometry.local_page_size, ctx.group_size, r, order=geometry.order,
                                        reason=str(refusal)) for r in range(ctx.group_size))
    verify_mappings(layer, mappings)  # R24: each page covered once, each writer index tiles the canonical page
    return mappings
