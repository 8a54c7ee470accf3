"""The derivation of canonical mappings (``kvoffload_ref.canonical_derive``, R24): the worked examples as exact
values, a byte-level oracle over Hypothesis-drawn parallel contexts and geometries (every rank's mapping
verifies; the writers of each page tile it exactly once, one per head shard and CP rank; the canonical page is
the page an unsharded model holds), a grid of more than 2,000 configurations, and a refusal for each gate."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload_ref.canonical import ByteRun, PageMapping
from kvoffload_ref.canonical_derive import (
    LayerGeometry,
    ParallelContext,
    UncertifiedLayoutError,
    certify,
    derive_layer,
    derive_mapping,
    opaque_mapping,
)
from kvoffload_ref.errors import InvalidTransferError


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# -- the worked examples ---------------------------------------------------------------------------------------


@pytest.mark.rule("R24")
def test_canonical_derive_worked_example_split_nhd_tp4_rank2() -> None:
    """NHD split, 4-token blocks, TP=4, rank 2, one local head of 128-byte token rows."""
    geometry = LayerGeometry("split", block_size=4, element_size=2, head_size=64, total_kv_heads=4,
                             local_kv_heads=1)
    mapping = certify(ParallelContext(tp=4, rank=2), geometry)
    assert (mapping.local_page_size, mapping.canonical_page_size) == (1024, 4096)
    assert mapping.runs == (ByteRun(0, 256, 128, 4, 128, 512), ByteRun(512, 2304, 128, 4, 128, 512))
    assert (mapping.num_writers, mapping.writer_index, mapping.parallelism_agnostic) == (1, 0, True)
    assert (mapping.format_id, mapping.opaque) == ("v1-nhd", False)
    src, dst, sizes = mapping.fragments()
    assert src.tolist() == [0, 128, 256, 384, 512, 640, 768, 896]
    assert dst.tolist() == [256, 768, 1280, 1792, *(2048 + x for x in (256, 768, 1280, 1792))]
    assert sizes.tolist() == [128] * 8 and mapping.copied_bytes == 1024


@pytest.mark.rule("R24")
def test_canonical_derive_worked_example_replication_tp8_two_heads() -> None:
    """TP=8 over 2 KV heads: 2 head shards, each replicated 4 times; 16-token bf16 blocks of head size 128."""
    geometry = LayerGeometry("split", block_size=16, element_size=2, head_size=128, total_kv_heads=2,
                             local_kv_heads=1)
    mappings = derive_layer("layers.0", ParallelContext(tp=8), geometry)
    for rank, mapping in enumerate(mappings):
        shard = rank // 4
        assert (mapping.local_page_size, mapping.canonical_page_size) == (8192, 16384)
        assert mapping.runs == (ByteRun(0, 256 * shard, 256, 16, 256, 512),
                                ByteRun(4096, 8192 + 256 * shard, 256, 16, 256, 512))
        assert (mapping.num_writers, mapping.writer_index) == (4, rank % 4)
    for page in range(12):
        assert [r for r, m in enumerate(mappings) if m.is_writer(page)] == [page % 4, 4 + page % 4]
    # With 8 local ranks and one block per chunk the legacy row holds 8 pages: 16 KiB of 64 KiB is used.
    assert mappings[0].canonical_page_size * 4 == 8 * mappings[0].local_page_size


def test_canonical_derive_single_rank_collapses_to_one_whole_page_run() -> None:
    for kind, order in itertools.product(("split", "packed"), ("NHD", "HND")):
        geometry = LayerGeometry(kind, 8, 2, head_size=16, total_kv_heads=4, local_kv_heads=4, order=order)  # type: ignore[arg-type]
        (mapping,) = derive_layer("L", ParallelContext(tp=1), geometry)
        assert mapping.runs == (ByteRun(0, 0, 2048, 1, 2048, 2048),) and mapping.format_id == f"v1-{order.lower()}"
    mla = derive_layer("L", ParallelContext(tp=4), LayerGeometry("mla", 16, 2, latent_size=576))
    assert {m.runs for m in mla} == {(ByteRun(0, 0, 18432, 1, 18432, 18432),)}
    assert [(m.num_writers, m.writer_index) for m in mla] == [(4, r) for r in range(4)]


def test_canonical_derive_context_parallel_deals_interleave_chunks() -> None:
    """MLA, DCP=2, interleave 2, 4-token blocks of 8-byte rows: rank c holds canonical tokens 2c, 2c+1, 4+2c, 5+2c."""
    mappings = derive_layer("L", ParallelContext(tp=2, dcp=2, interleave=2), LayerGeometry("mla", 4, 1, latent_size=8))
    assert mappings[0].runs == (ByteRun(0, 0, 16, 1, 16, 16), ByteRun(16, 32, 16, 1, 16, 16))
    assert mappings[1].runs == (ByteRun(0, 16, 16, 1, 16, 16), ByteRun(16, 48, 16, 1, 16, 16))
    assert [(m.canonical_page_size, m.num_writers, m.writer_index, m.parallelism_agnostic) for m in mappings] == [
        (64, 1, 0, False)] * 2


# -- the oracle: the canonical page is the unsharded model's page ----------------------------------------------


def _physical(block: np.ndarray, kind: str, order: str) -> np.ndarray:
    """A page's bytes, flat, from ``block[half, token, head, byte]`` (MLA: ``block[token, byte]``)."""
    if kind == "mla":
        return block.reshape(-1)
    axes = {("split", "NHD"): (0, 1, 2, 3), ("split", "HND"): (0, 2, 1, 3),
            ("packed", "NHD"): (1, 2, 0, 3), ("packed", "HND"): (2, 1, 0, 3)}[(kind, order)]
    return np.ascontiguousarray(block.transpose(axes)).reshape(-1)


def _rank_tokens(ctx: ParallelContext, block_size: int) -> np.ndarray:
    """The canonical tokens rank ``ctx.rank`` holds, in local order (the CP interleave's deal)."""
    local = np.arange(block_size)
    if ctx.cp == 1:
        return local
    step = ctx.interleave
    return ((local // step) * ctx.cp + ctx.cp_rank) * step + local % step


def _check_against_unsharded_model(ctx: ParallelContext, g: LayerGeometry, mappings: tuple[PageMapping, ...]) -> None:
    span, kind = g.block_size * ctx.cp, g.kind
    if kind == "mla":
        full = np.arange(span * g.latent_size * g.element_size).reshape(span, -1)
    else:
        heads = g.total_kv_heads  # the unsharded model holds every head once
        full = np.arange(2 * span * heads * g.head_size * g.element_size).reshape(2, span, heads, -1)
    expected = _physical(full, kind, g.order)
    replication = 1 if kind == "mla" or g.total_kv_heads >= ctx.tp else ctx.tp // g.total_kv_heads
    pages = []
    for rank, mapping in enumerate(mappings):
        rc = ctx.with_rank(rank)
        tokens = _rank_tokens(rc, g.block_size)
        if kind == "mla":
            local = full[tokens]
        else:
            first = (rc.tp_rank // replication) * g.local_kv_heads
            local = full[:, tokens][:, :, first:first + g.local_kv_heads]
        pages.append(_physical(local, kind, g.order))
        assert len(pages[-1]) == mapping.local_page_size == g.local_page_size
    num_writers = mappings[0].num_writers
    for page_id in range(num_writers):
        canonical = np.full(mappings[0].canonical_page_size, -1, dtype=np.int64)
        count = np.zeros_like(canonical)
        writers = [r for r, m in enumerate(mappings) if m.is_writer(page_id)]
        for r in writers:  # a store: every writer copies its fragments local -> canonical
            src, dst, sizes = mappings[r].fragments()
            for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
                canonical[d:d + n] = pages[r][s:s + n]
                count[d:d + n] += 1
        assert (count == 1).all(), f"page {page_id}: writers {writers} do not tile the canonical page once"
        assert np.array_equal(canonical, expected), f"page {page_id}: not the unsharded model's page"
        # Exactly one writer per (head shard, CP rank): replicated bytes are stored once.
        owners = {((ctx.with_rank(r).tp_rank // replication) if kind != "mla" else 0, ctx.with_rank(r).cp_rank)
                  for r in writers}
        shards = 1 if kind == "mla" else ctx.tp // replication
        assert len(owners) == len(writers) == shards * ctx.cp
    for r, mapping in enumerate(mappings):  # a load: never filtered, each rank reads its own bytes back
        src, dst, sizes = mapping.fragments()
        back = np.full(mapping.local_page_size, -1, dtype=np.int64)
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
            back[s:s + n] = expected[d:d + n]
        assert np.array_equal(back, pages[r])


@st.composite
def valid_layers(draw: st.DrawFn) -> tuple[ParallelContext, LayerGeometry]:
    """A parallel context and a layer every gate certifies."""
    kind = draw(st.sampled_from(["split", "packed", "mla"]))
    order = draw(st.sampled_from(["NHD", "HND"]))
    tp, pcp = draw(st.sampled_from([1, 2, 3, 4, 6, 8])), draw(st.integers(1, 3))
    bs, elem = draw(st.sampled_from([1, 2, 3, 4, 8, 16])), draw(st.sampled_from([1, 2]))
    if kind == "mla":
        dcp = draw(st.sampled_from(_divisors(tp)))
        geometry = LayerGeometry("mla", bs, elem, latent_size=draw(st.integers(1, 12)), order=order)
    else:
        total = draw(st.sampled_from(sorted({*_divisors(tp), tp, 2 * tp, 3 * tp})))
        dcp = draw(st.sampled_from(_divisors(tp // total if total < tp else 1)))
        local = max(1, total // tp)
        flattened = kind == "split" and order == "NHD" and local != 2 and draw(st.booleans())
        geometry = LayerGeometry(kind, bs, elem, head_size=draw(st.integers(1, 4)), total_kv_heads=total,
                                 local_kv_heads=local, order=order, heads_flattened=flattened)
        if draw(st.booleans()):  # the strides spelled out, the block stride padded
            strides = geometry.dense_strides()
            geometry = LayerGeometry(kind, bs, elem, head_size=geometry.head_size, total_kv_heads=total,
                                     local_kv_heads=local, order=order, heads_flattened=flattened,
                                     strides=(strides[0] + draw(st.integers(0, 64)), *strides[1:]))
    cp = dcp * pcp
    interleave = draw(st.sampled_from(_divisors(bs))) if cp > 1 else draw(st.integers(1, 32))
    return ParallelContext(tp, dcp, pcp, interleave), geometry


@pytest.mark.rule("R24")
@given(valid_layers())
def test_canonical_derive_every_rank_verifies_and_writers_tile_each_page_once(
        case: tuple[ParallelContext, LayerGeometry]) -> None:
    ctx, geometry = case
    mappings = derive_layer("L", ctx, geometry)  # verifies R24 itself
    assert len(mappings) == ctx.tp * ctx.pcp
    assert not any(m.opaque for m in mappings)
    assert all(m.parallelism_agnostic == (ctx.cp == 1) for m in mappings)
    assert mappings == tuple(derive_mapping(ctx.with_rank(r), geometry) for r in range(len(mappings)))
    _check_against_unsharded_model(ctx, geometry, mappings)


@pytest.mark.rule("R24")
def test_canonical_derive_grid_of_configurations_all_certified_and_tiled() -> None:
    """Every valid (tp, H, dcp, pcp, interleave, block size, kind, order) of a grid: more than 2,000 of them."""
    contexts = 0
    for tp, pcp, bs, kind, order in itertools.product((1, 2, 4, 8), (1, 2), (1, 2, 4, 16), ("split", "packed", "mla"),
                                                      ("NHD", "HND")):
        totals = [1] if kind == "mla" else sorted({*_divisors(tp), 2 * tp, 4 * tp})
        for total in totals:
            replication = tp if kind == "mla" else (tp // total if total < tp else 1)
            for dcp in _divisors(replication):
                for interleave in (_divisors(bs) if dcp * pcp > 1 else [1]):
                    ctx = ParallelContext(tp, dcp, pcp, interleave)
                    geometry = (LayerGeometry("mla", bs, 2, latent_size=3, order=order) if kind == "mla" else
                                LayerGeometry(kind, bs, 1, head_size=2, total_kv_heads=total,  # type: ignore[arg-type]
                                              local_kv_heads=max(1, total // tp), order=order))  # type: ignore[arg-type]
                    mappings = derive_layer("L", ctx, geometry)
                    assert not any(m.opaque for m in mappings)
                    for page_id in range(mappings[0].num_writers):  # an independent count of each canonical byte
                        count = np.zeros(mappings[0].canonical_page_size, dtype=np.int64)
                        for m in mappings:
                            if m.is_writer(page_id):
                                _src, dst, sizes = m.fragments()
                                np.add.at(count, np.repeat(dst, sizes) + _ramps(sizes), 1)
                        assert (count == 1).all()
                    contexts += 1
    assert contexts >= 2000, contexts


def _ramps(sizes: np.ndarray) -> np.ndarray:
    """``0..sizes[i]-1`` for each i, concatenated."""
    first = np.cumsum(sizes) - sizes
    return np.arange(int(sizes.sum())) - np.repeat(first, sizes)


# -- the gates: each refusal, and the fallback -----------------------------------------------------------------

_KV: dict[str, Any] = {"kind": "split", "block_size": 16, "element_size": 2, "head_size": 8, "total_kv_heads": 8,
                       "local_kv_heads": 2}
_MLA: dict[str, Any] = {"kind": "mla", "block_size": 16, "element_size": 2, "latent_size": 8}

GATES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("attention", {"tp": 4}, {"kind": "other", "block_size": 16, "element_size": 1, "page_bytes": 4096},
     "only attention layers"),
    ("interleave", {"tp": 4, "pcp": 2, "interleave": 32}, _KV, "interleave 32 must divide the block size 16"),
    ("interleave", {"tp": 4, "dcp": 1, "pcp": 2, "interleave": 3}, _KV, "interleave 3 must divide"),
    ("compress_ratio", {"tp": 2}, {**_MLA, "compress_ratio": 4}, "compress_ratio = 4, expected 1"),
    ("mla_page", {"tp": 2}, {**_MLA, "page_bytes": 250}, "250-byte page is not 16 equal token rows"),
    ("mla_dcp", {"tp": 6, "dcp": 4}, _MLA, "tp = 6 is not a multiple of dcp = 4"),
    ("quantization", {"tp": 2}, {**_MLA, "per_token_head_quant": True}, "per-token-head"),
    ("quantization", {"tp": 4}, {**_KV, "per_token_head_quant": True}, "per-token-head"),
    ("local_heads", {"tp": 4}, {**_KV, "local_kv_heads": 8}, r"holds 8 KV heads, expected max\(1, 8 // 4\) = 2"),
    ("head_split", {"tp": 3}, {**_KV, "local_kv_heads": 2}, "8 KV heads do not split evenly over tp = 3"),
    ("head_split", {"tp": 12}, {**_KV, "local_kv_heads": 1}, "tp = 12 is not a multiple of the 8 KV heads"),
    ("replication_dcp", {"tp": 4, "dcp": 2}, _KV, "replicated 1 times, not a multiple of dcp = 2"),
    ("replication_dcp", {"tp": 16, "dcp": 4}, {**_KV, "local_kv_heads": 1}, "replicated 2 times"),
    ("page_size", {"tp": 4}, {**_KV, "page_bytes": 1024 + 64}, "1088 bytes, not the dense 1024"),
    ("strides", {"tp": 4}, {**_KV, "strides": (1024, 256, 16, 8, 2)}, "show no dense NHD or HND layout"),
    ("strides", {"tp": 4}, {**_KV, "strides": (1024, 256, 8, 128, 1)}, "show a dense HND layout; the layout family"),
    ("strides", {"tp": 4}, {**_KV, "kind": "packed", "strides": (512, 16, 32)}, "no dense NHD or HND"),
    ("strides", {"tp": 2}, {**_KV, "local_kv_heads": 4, "heads_flattened": True, "strides": (1024, 512, 32, 2)},
     "not a flattened split"),
    ("ambiguous", {"tp": 4}, {**_KV, "heads_flattened": True}, "two flattened heads"),
]


@pytest.mark.rule("R24")
@pytest.mark.parametrize(("gate", "ctx", "geometry", "match"), GATES, ids=[f"{g[0]}-{i}" for i, g in enumerate(GATES)])
def test_canonical_derive_refuses_each_gate_and_falls_back_opaque(gate: str, ctx: dict[str, Any],
                                                                  geometry: dict[str, Any], match: str) -> None:
    context, layer = ParallelContext(**ctx), LayerGeometry(**geometry)
    with pytest.raises(UncertifiedLayoutError, match=match) as caught:
        certify(context, layer)
    assert caught.value.gate == gate and isinstance(caught.value, InvalidTransferError)
    mappings = derive_layer("L", context, layer)  # fails closed: every rank opaque, and verified
    page, world = layer.local_page_size, context.tp * context.pcp
    for rank, mapping in enumerate(mappings):
        assert mapping == opaque_mapping(page, world, rank, order=layer.order, reason=str(caught.value))
        assert mapping.runs == (ByteRun(0, rank * page, page, 1, page, page),)
        assert (mapping.canonical_page_size, mapping.num_writers, mapping.parallelism_agnostic) == (
            world * page, 1, False)
        assert mapping.opaque and mapping.fallback_reason.startswith(f"cannot certify a canonical mapping ({gate})")
    assert derive_mapping(context.with_rank(world - 1), layer) == mappings[-1]


@pytest.mark.rule("R24")
def test_canonical_derive_refuses_a_group_that_is_not_the_tp_pcp_grid() -> None:
    context, layer = ParallelContext(tp=4, pcp=1, rank=5, world_size=8), LayerGeometry(**_KV)
    for call in (certify, derive_mapping, lambda c, g: derive_layer("L", c, g)):
        with pytest.raises(UncertifiedLayoutError, match=r"\(world\): the worker group has 8 ranks.* = 4") as caught:
            call(context, layer)
        assert caught.value.gate == "world"
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (copy.gate, str(copy)) == ("world", str(caught.value))


def test_canonical_derive_flattened_heads_other_than_two_are_certified() -> None:
    plain = derive_layer("L", ParallelContext(tp=2), LayerGeometry(**{**_KV, "local_kv_heads": 4}))
    flat = derive_layer("L", ParallelContext(tp=2), LayerGeometry(**{**_KV, "local_kv_heads": 4,
                                                                      "heads_flattened": True}))
    assert flat == plain and not flat[0].opaque


@pytest.mark.parametrize(("factory", "kw", "match"), [
    (ParallelContext, {"tp": 0}, r"ParallelContext.tp must be an int in \[1, "),
    (ParallelContext, {"tp": 2, "rank": 2}, r"ParallelContext.rank must be an int in \[0, 1\]"),
    (ParallelContext, {"tp": 2, "world_size": 0}, "world_size must be"),
    (LayerGeometry, {**_KV, "kind": "mamba"}, "kind must be one of"),
    (LayerGeometry, {**_KV, "order": "NDH"}, "'NHD' or 'HND'"),
    (LayerGeometry, {**_KV, "head_size": 0}, "head_size must be"),
    (LayerGeometry, {"kind": "other", "block_size": 1, "element_size": 1}, "kind 'other' needs page_bytes"),
    (LayerGeometry, {"kind": "mla", "block_size": 1, "element_size": 1}, "needs page_bytes or latent_size"),
    (LayerGeometry, {**_MLA, "heads_flattened": True}, "applies to split KV only"),
    (LayerGeometry, {**_KV, "per_token_head_quant": 1}, "per_token_head_quant must be a bool"),
    (LayerGeometry, {**_KV, "strides": 5}, "strides must be a sequence of ints"),
    (LayerGeometry, {**_KV, "strides": (1, -1)}, r"strides\[1\] must be"),
])
def test_canonical_derive_refuses_invalid_inputs(factory: Any, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidTransferError, match=match):
        factory(**kw)


def test_canonical_derive_refuses_wrong_argument_types() -> None:
    with pytest.raises(InvalidTransferError, match="ctx must be a ParallelContext"):
        certify((4, 1, 1, 1, 0), LayerGeometry(**_KV))  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match="geometry must be a LayerGeometry"):
        derive_layer("L", ParallelContext(tp=4), _KV)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match="rank must be an int in"):
        opaque_mapping(64, 2, 2)
