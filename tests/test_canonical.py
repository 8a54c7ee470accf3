"""The canonical layout's mapping model (``kvoffload_ref.canonical``): byte runs, page mappings, rotating writers
and the verification of R24, with its messages for a gap, an overlap and a disagreement."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from kvoffload_ref.canonical import (
    CANONICAL_FORMAT_VERSION,
    ByteRun,
    MappingError,
    PageMapping,
    canonical_format_id,
    verify_mapping,
    verify_mappings,
)
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.errors import InvalidTransferError


def _whole(local: int, canonical_offset: int, canonical_page: int, **kw: Any) -> PageMapping:
    """A mapping that copies a whole ``local``-byte page to ``canonical_offset``."""
    return PageMapping(canonical_page, local, (ByteRun(0, canonical_offset, local, 1, local, local),), **kw)


def test_canonical_format_id_couples_version_and_layout_family() -> None:
    assert CANONICAL_FORMAT_VERSION == 1
    assert canonical_format_id("NHD") == "v1-nhd" and canonical_format_id("HND") == "v1-hnd"
    with pytest.raises(InvalidTransferError, match="'NHD' or 'HND'"):
        canonical_format_id("nhd")


def test_canonical_run_unrolls_into_strided_fragments() -> None:
    mapping = PageMapping(4096, 1024, [ByteRun(0, 256, 128, 4, 128, 512), ByteRun(512, 2304, 128, 4, 128, 512)])
    local, canonical, sizes = mapping.fragments()
    assert local.tolist() == list(range(0, 1024, 128))
    assert canonical.tolist() == [256, 768, 1280, 1792, 2304, 2816, 3328, 3840]
    assert sizes.tolist() == [128] * 8 and not local.flags.writeable
    assert isinstance(mapping.runs, tuple) and mapping.copied_bytes == 1024 and mapping.num_fragments == 8
    assert mapping.runs[0].nbytes == 512 and mapping.runs[0].local_end() == 512
    assert mapping.runs[1].canonical_end() == 3968


@pytest.mark.rule("R24")
def test_canonical_is_writer_rotates_pages_over_the_writers() -> None:
    writers = [PageMapping(1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)], 4, w) for w in range(4)]
    assert [[m.is_writer(p) for p in range(8)].count(True) for m in writers] == [2, 2, 2, 2]
    assert [next(w for w, m in enumerate(writers) if m.is_writer(p)) for p in range(8)] == [0, 1, 2, 3] * 2
    assert writers[3].is_writer(np.int64(7))
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(InvalidTransferError, match="page_id"):
            writers[0].is_writer(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "match"), [
    ({"fragment_size": 0}, r"fragment_size must be an int in \[1, "),
    ({"num_fragments": 0}, r"num_fragments must be an int in \[1, "),
    ({"local_offset": -1}, r"local_offset must be an int in \[0, .*got -1"),
    ({"canonical_stride": 1.5}, "canonical_stride must be an int"),
    ({"local_stride": True}, "local_stride must be an int"),
])
def test_canonical_run_refuses_bad_fields(fields: dict[str, Any], match: str) -> None:
    base = {"local_offset": 0, "canonical_offset": 0, "fragment_size": 8, "num_fragments": 2,
            "local_stride": 8, "canonical_stride": 8}
    with pytest.raises(InvalidTransferError, match=match):
        ByteRun(**{**base, **fields})


@pytest.mark.rule("R24")
@pytest.mark.parametrize(("args", "kw", "match"), [
    ((1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)]), {"num_writers": 0}, "num_writers must be"),
    ((1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)]), {"num_writers": 2, "writer_index": 2}, r"writer_index .*\[0, 1\]"),
    ((1024, 0, []), {}, "local_page_size must be"),
    ((1024, 512, "runs"), {}, "runs must be a sequence of ByteRun"),
    ((1024, 512, [(0, 0, 512, 1, 512, 512)]), {}, r"runs\[0\] must be a ByteRun"),
    ((1024, 512, [ByteRun(256, 0, 512, 1, 512, 512)]), {}, r"runs\[0\] reaches local byte 768"),
    ((1024, 512, [ByteRun(0, 768, 512, 1, 512, 512)]), {}, r"runs\[0\] reaches canonical byte 1280"),
    ((1024, 4, [ByteRun(0, 0, 1, 5, 0, 1)]), {}, "5 fragments for a local page of 4 bytes"),
    ((1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)]), {"opaque": True}, "cannot be parallelism_agnostic"),
    ((1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)]), {"fallback_reason": "x"}, "only an opaque mapping"),
    ((1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)]), {"opaque": 1}, "opaque must be a bool"),
    ((1024, 512, [ByteRun(0, 0, 512, 1, 512, 512)]), {"format_id": 1}, "format_id must be a str"),
])
def test_canonical_mapping_refuses_bad_fields(args: tuple[Any, ...], kw: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidTransferError, match=match):
        PageMapping(*args, **kw)


@pytest.mark.rule("R24")
def test_canonical_verify_names_layer_rank_and_first_gap_of_the_local_page() -> None:
    mapping = PageMapping(1024, 512, [ByteRun(0, 0, 128, 1, 128, 128), ByteRun(256, 256, 128, 2, 128, 128)])
    with pytest.raises(MappingError) as caught:
        verify_mapping("model.layers.3.attn", 5, mapping)
    assert str(caught.value) == ("layer 'model.layers.3.attn', rank 5: the runs leave a gap in the local page at "
                                 "byte 128 (128 bytes uncovered)")
    error = caught.value
    assert (error.layer, error.rank, error.problem, error.page, error.offset, error.writer_index) == (
        "model.layers.3.attn", 5, "gap", "local", 128, None)
    assert isinstance(error, InvalidTransferError) and isinstance(error, ValueError)
    tail = PageMapping(1024, 512, [ByteRun(0, 0, 128, 3, 128, 128)])
    with pytest.raises(MappingError, match="gap in the local page at byte 384 \\(128 bytes uncovered\\)"):
        verify_mapping("L", 0, tail)
    with pytest.raises(MappingError, match="gap in the local page at byte 0 \\(512 bytes"):
        verify_mapping("L", 0, PageMapping(1024, 512, []))


@pytest.mark.rule("R24")
def test_canonical_verify_names_layer_rank_and_first_overlap_of_the_local_page() -> None:
    mapping = PageMapping(1024, 512, [ByteRun(0, 0, 256, 1, 256, 256), ByteRun(192, 256, 64, 5, 64, 64)])
    with pytest.raises(MappingError) as caught:
        verify_mapping("L7", 2, mapping)
    assert str(caught.value) == ("layer 'L7', rank 2: the runs overlap in the local page at byte 192: runs[0] and "
                                 "runs[1] both cover it")
    assert (caught.value.problem, caught.value.offset, caught.value.rank) == ("overlap", 192, 2)
    self_overlap = PageMapping(1024, 512, [ByteRun(0, 0, 256, 2, 128, 256), ByteRun(384, 512, 128, 1, 128, 128)])
    with pytest.raises(MappingError, match="at byte 128: runs\\[0\\] and runs\\[0\\]"):
        verify_mapping("L", 0, self_overlap)


@pytest.mark.rule("R24")
def test_canonical_verify_refuses_a_rank_that_writes_canonical_bytes_twice() -> None:
    """Two runs at canonical offset 0: the local page is covered once, but canonical bytes [128, 256) would never
    be written by this rank while its stores report success."""
    twice = PageMapping(256, 256, [ByteRun(0, 0, 128, 1, 128, 128), ByteRun(128, 0, 128, 1, 128, 128)])
    with pytest.raises(MappingError) as caught:
        verify_mapping("model.layers.0.attn", 3, twice)
    assert str(caught.value) == ("layer 'model.layers.0.attn', rank 3: the runs write canonical bytes [0, 128) "
                                 "twice: runs[0] and runs[1] both write them (each canonical byte must come from "
                                 "one local byte)")
    error = caught.value
    assert (error.layer, error.rank, error.problem, error.page, error.offset, error.writer_index) == (
        "model.layers.0.attn", 3, "overlap", "canonical", 0, None)
    with pytest.raises(MappingError, match=r"rank 0: the runs write canonical bytes \[0, 128\) twice"):
        CanonicalLayout([twice])  # what both workers build from canonical=: refused before any device work
    with pytest.raises(MappingError, match=r"rank 1: the runs write canonical bytes \[0, 128\) twice"):
        verify_mappings("L", [_whole(256, 0, 256), twice])  # the group check names the rank, not a writer clash
    # A partial overlap: the range is the bytes both fragments write; within one run (a stride below the fragment).
    partial = PageMapping(1024, 512, [ByteRun(0, 512, 256, 1, 256, 256), ByteRun(256, 640, 256, 1, 256, 256)])
    with pytest.raises(MappingError, match=r"canonical bytes \[640, 768\) twice: runs\[0\] and runs\[1\]"):
        verify_mapping("L", 0, partial)
    strided = PageMapping(1024, 512, [ByteRun(0, 0, 128, 4, 128, 64)])
    with pytest.raises(MappingError, match=r"canonical bytes \[64, 128\) twice: runs\[0\] and runs\[0\]"):
        verify_mapping("L", 0, strided)
    # Gaps in the canonical page are a rank's right (the other ranks write the rest), touching fragments are fine.
    verify_mapping("L", 0, PageMapping(1024, 512, [ByteRun(0, 768, 256, 1, 256, 256), ByteRun(256, 0, 128, 2, 128,
                                                                                               256)]))


@pytest.mark.rule("R24")
def test_canonical_verify_group_names_the_rank_of_a_canonical_gap() -> None:
    ranks = [_whole(256, 0, 1024), _whole(256, 256, 1024), _whole(256, 768, 1024)]
    with pytest.raises(MappingError) as caught:
        verify_mappings("L0", ranks)
    assert str(caught.value) == ("layer 'L0', rank 2: writer index 0 (ranks [0, 1, 2]) leaves a gap in the "
                                 "canonical page at byte 512 (256 bytes no writer stores)")
    assert (caught.value.rank, caught.value.page, caught.value.offset, caught.value.writer_index) == (
        2, "canonical", 512, 0)
    with pytest.raises(MappingError, match=r"rank 1: writer index 0 .* canonical page at byte 512 \(512 bytes"):
        verify_mappings("L0", ranks[:2])


@pytest.mark.rule("R24")
def test_canonical_verify_group_names_the_rank_of_a_canonical_overlap() -> None:
    ranks = [_whole(512, 0, 1024), _whole(512, 256, 1024)]
    with pytest.raises(MappingError) as caught:
        verify_mappings("L1", ranks)
    assert str(caught.value) == ("layer 'L1', rank 1: writer index 0 (ranks [0, 1]) overlaps in the canonical "
                                 "page at byte 256: rank 0 already stores it")
    assert (caught.value.problem, caught.value.rank, caught.value.offset) == ("overlap", 1, 256)


@pytest.mark.rule("R24")
def test_canonical_verify_group_checks_each_writer_index_on_its_own() -> None:
    # Two head shards, each replicated twice: writer 0 of both shards tiles page 0, writer 1 tiles page 1.
    good = [_whole(256, 256 * (r // 2), 512, num_writers=2, writer_index=r % 2) for r in range(4)]
    verify_mappings("L", good)
    # Writer index 1 lost its shard-1 writer (rank 3 claims index 0): index 0 overlaps first, at byte 256.
    bad = [*good[:3], _whole(256, 256, 512, num_writers=2, writer_index=0)]
    with pytest.raises(MappingError, match=r"rank 3: writer index 0 \(ranks \[0, 2, 3\]\) overlaps .* byte 256"):
        verify_mappings("L", bad)
    lonely = [_whole(256, 0, 256, num_writers=2, writer_index=0)]
    with pytest.raises(MappingError) as caught:
        verify_mappings("L", lonely)
    assert str(caught.value) == ("layer 'L': writer index 1, which no rank holds, leaves a gap in the canonical "
                                 "page at byte 0 (256 bytes no writer stores)")
    assert caught.value.rank is None and caught.value.writer_index == 1


@pytest.mark.rule("R24")
def test_canonical_verify_group_refuses_ranks_that_disagree() -> None:
    cases = [
        ([_whole(256, 0, 512), _whole(256, 256, 768)], "rank 1: canonical_page_size = 768 differs from rank 0's 512"),
        ([_whole(256, 0, 256), _whole(256, 0, 256, num_writers=2, writer_index=1)], "rank 1: num_writers = 2"),
        ([_whole(256, 0, 512), _whole(256, 256, 512, format_id="v1-hnd")], "rank 1: format_id = 'v1-hnd'"),
    ]
    for ranks, match in cases:
        with pytest.raises(MappingError, match=match) as caught:
            verify_mappings("L", ranks)
        assert caught.value.problem == "mismatch"
    # A rank's own page is checked too, and named.
    with pytest.raises(MappingError, match="layer 'L', rank 1: the runs leave a gap in the local page at byte 128"):
        verify_mappings("L", [_whole(256, 0, 512), PageMapping(512, 256, [ByteRun(0, 256, 128, 1, 128, 128)])])


def test_canonical_verify_refuses_wrong_argument_types() -> None:
    good = _whole(256, 0, 256)
    for call, match in [
        (lambda: verify_mappings("L", []), "non-empty sequence of PageMapping"),
        (lambda: verify_mappings("L", [good, "x"]), r"mappings\[1\] must be a PageMapping"),  # type: ignore[list-item]
        (lambda: verify_mappings(3, [good]), "layer must be a str"),  # type: ignore[arg-type]
        (lambda: verify_mapping("L", -1, good), "rank must be >= 0"),
    ]:
        with pytest.raises(InvalidTransferError, match=match):
            call()


def test_canonical_mapping_error_survives_pickling() -> None:
    with pytest.raises(MappingError) as caught:
        verify_mappings("L", [_whole(512, 0, 1024), _whole(512, 256, 1024)])
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value)
    assert (copy.layer, copy.rank, copy.problem, copy.page, copy.offset, copy.writer_index) == (
        "L", 1, "overlap", "canonical", 256, 0)
