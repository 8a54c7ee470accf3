"""R7's message rule beyond the shared validators: every refusal raised inside the simulated device, the regions
and the conformance kit names the field, shows the value (short) and gives a valid example or the valid range."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.trace_format import load_trace
from kvoffload_ref.cli import main
from kvoffload_ref.testing import Setup, SimDevice, mutants
from kvoffload_ref.testing.campaign import run_campaign
from kvoffload_ref.testing.explorer import explore
from kvoffload_ref.testing.jobs import run_jobs
from kvoffload_ref.testing.pairs import explore_pairs
from kvoffload_ref.testing.settings import bounded_shrinking

_LAYOUT = kv.KVCacheLayout(tensor_page_bytes=(512, 512), groups=((kv.LayerRef(0, 512), kv.LayerRef(1, 512)),))
_PTR, _PAGE = 0x1000_0000, 4096
_SETUP = Setup(layout=_LAYOUT, blocks_per_chunk=3, num_gpu_blocks=8, num_cpu_chunks=4, gpu_row_pad=(0, 0),
               policy=kv.ShutdownPolicy())


def _tracked(be: SimBackend) -> SimBackend:
    be.track_host(_PTR, 3 * _PAGE)
    return be


def _no_shrinking() -> None:
    with bounded_shrinking(0):
        pass


def _trace_file(tmp: pathlib.Path) -> dict[str, Any]:
    (tmp / "t.json").write_text('"not a trace"')
    return load_trace(str(tmp / "t.json"))


#: (field, the value as the message shows it, a call making the refusal on a fresh SimBackend ``be`` and a
#: temporary directory)
BAD: list[tuple[str, str, Callable[[SimBackend, pathlib.Path], object]]] = [
    ("stream", "5", lambda be, tmp: be.compute_stream(5)),  # type: ignore[arg-type]
    ("count", "2", lambda be, tmp: be.copy_batch(be.create_stream(), be.alloc_descriptors(1), 2)),
    ("seconds", "1e+308", lambda be, tmp: (be.sleep(1e308), be.sleep(1e308))),
    ("rows", "[8]", lambda be, tmp: be.enqueue_compute_write(be.empty_device((8, 64)), [8], 1, 0.0)),
    ("ptr", "0x0", lambda be, tmp: be.track_host(0, 4096)),
    ("ptr", f"{_PTR + 1:#x}", lambda be, tmp: _tracked(be).untrack_host_pages(_PTR + 1, _PAGE)),
    ("ptr", f"{_PTR:#x}", lambda be, tmp: _tracked(be).track_host(_PTR, _PAGE)),
    ("trace", "'yes'", lambda be, tmp: SimBackend(trace="yes")),  # type: ignore[arg-type]
    ("race_check", "1", lambda be, tmp: SimBackend(race_check=1)),  # type: ignore[arg-type]
    ("trace", "False", lambda be, tmp: be.trace_document()),
    ("array", "'x'", lambda be, tmp: be.to_host("x")),  # type: ignore[arg-type]
    ("array", "strides", lambda be, tmp: be.to_host(be.empty_device((4, 64))[:, ::2])),
    ("array", "shape (4, 64)", lambda be, tmp: be.to_host(np.zeros((4, 64), np.uint8))),
    ("shape", "'x'", lambda be, tmp: be.empty_device("x")),  # type: ignore[arg-type]
    ("shape", f"({2**62}, 4)", lambda be, tmp: be.empty_device((2**62, 4))),
    ("array", "shape (4,)", lambda be, tmp: be.from_host(np.zeros(4, np.uint8))),
    ("num_cpu_chunks", f"{2**61}", lambda be, tmp: kv.HostRegion.allocate(be, _LAYOUT, 3, 2**61)),
    ("backend", "'sim'", lambda be, tmp: kv.HostRegion.allocate(be, _LAYOUT, 3, 4).check_backend(SimBackend())),
    ("engine_id", "5", lambda be, tmp: kv.SharedRegion.open(5, backend=be, layout=_LAYOUT,  # type: ignore[arg-type]
                                                           blocks_per_chunk=3, num_cpu_chunks=4, rank=0,
                                                           world_size=1, directory=tmp)),
    ("engine_id", "'a/b'", lambda be, tmp: kv.SharedRegion.open("a/b", backend=be, layout=_LAYOUT,
                                                               blocks_per_chunk=3, num_cpu_chunks=4, rank=0,
                                                               world_size=1, directory=tmp)),
    ("engine_id", "characters)", lambda be, tmp: kv.SharedRegion.open("e" * 300, backend=be, layout=_LAYOUT,
                                                                     blocks_per_chunk=3, num_cpu_chunks=4, rank=0,
                                                                     world_size=1, directory=tmp)),
    ("replicated", "'yes'", lambda be, tmp: kv.SharedRegion.open("e", backend=be, layout=_LAYOUT,
                                                                blocks_per_chunk=3, num_cpu_chunks=4, rank=0,
                                                                world_size=1, replicated="yes",  # type: ignore[arg-type]
                                                                directory=tmp)),
    ("path", "t.json", lambda be, tmp: _trace_file(tmp)),
    ("seconds", "0", lambda be, tmp: _no_shrinking()),
    ("steps", "0", lambda be, tmp: run_campaign(0, 1, None)),
    ("policy", "'free'", lambda be, tmp: run_campaign(1, 1, "free")),
    ("jobs", "0", lambda be, tmp: run_jobs("kvoffload_ref.testing.adapter:reference_factory", 0, 10, 1, None)),
    ("configs", "'nope'", lambda be, tmp: explore(configs=["nope"])),
    ("firsts", "'nope'", lambda be, tmp: explore_pairs(firsts=["nope"])),
    ("job_id", "str 'x'", lambda be, tmp: _order_after_ignored(["x"])),  # the worker's own R7 check
]


def _order_after_ignored(ids: list[object]) -> None:
    """``order_after(ids)`` on the kit's mutant whose order_after orders nothing (it still refuses a bad id, R7)."""
    dev = SimDevice(_SETUP)
    worker = mutants.order_after_ignored(dev.backend, dev.gpu, _SETUP)
    try:
        worker.order_after(ids)  # type: ignore[arg-type]
    finally:
        worker.shutdown()


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("field", "shown", "call"), BAD, ids=[f"{f}:{s}"[:40] for f, s, _ in BAD])
def test_messages_name_the_field_the_value_and_a_valid_example(
        tmp_path: pathlib.Path, field: str, shown: str, call: Callable[[SimBackend, pathlib.Path], object]) -> None:
    be = SimBackend()
    with pytest.raises((ValueError, TypeError)) as info:
        call(be, tmp_path)
    text = str(info.value)
    assert field in text, text
    assert shown in text, text
    assert "expected" in text or "e.g." in text, text
    assert len(text) < 600, text  # shortened: a huge value is not printed whole


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("argv", "shown"), [
    (["fuzz", "--steps", "0"], "got 0"),
    (["fuzz", "--steps", "many"], "got 'many'"),
    (["fuzz", "--seconds", "-1"], "got -1.0"),
    (["fuzz", "--shrink-seconds", "soon"], "got 'soon'"),
])
def test_messages_cli_options_name_the_option_the_value_and_an_example(
        capsys: pytest.CaptureFixture[str], argv: list[str], shown: str) -> None:
    """The kit's CLI refuses a bad number with exit 2 and one line naming the option, the value and an example."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"argument {argv[1]}" in err and shown in err and "e.g." in err, err
