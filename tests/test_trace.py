"""Timelines: the sim's Chrome trace-event JSON (schema, one span per copy, flows, fault and violation markers),
``demo --trace`` and the layer-wise example's ``--trace``, the CuPy backend's trace from CUDA events (fake runtime),
merging, and ``trace-plot``'s PNG (skipped without matplotlib) and its hint when matplotlib is missing."""

from __future__ import annotations

import builtins
import importlib.util
import json
import pathlib
import sys
from collections import Counter
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref import cli
from kvoffload_ref.backends._cupy_runtime import CudaCalls
from kvoffload_ref.backends._cupy_trace import CupyTracer
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.trace_format import check_trace, load_trace, merge
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples"
PAGE = 4096


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_example_layerwise_trace", EXAMPLES / "layerwise_prefetch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _spans(doc: dict[str, Any], cat: str) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == cat]


def test_trace_sim_layerwise_schedule_passes_the_schema() -> None:
    example = _example()
    be, gpu = example.sim_device(profile="h200", trace=True)
    copies = Counter[str]()
    be.on_call = lambda point, tag: copies.update([point])
    figures = example.run_step(be, gpu)
    be.on_call = None
    doc = be.trace_document()
    assert check_trace(doc) == [] and figures.violations == ()
    assert all({"ph", "ts", "pid", "tid"} <= set(e) for e in doc["traceEvents"])
    spans = _spans(doc, "copy")
    assert len(spans) == copies["copy"] == doc["otherData"]["copies"], "one span per copy submitted"
    names = {e["name"] for e in spans}
    assert {"store job 0", "load job 100", "store job 200"} <= names
    assert all({"bytes", "descriptors", "path", "gbps"} <= set(e["args"]) for e in spans)
    assert {e["args"]["path"] for e in spans} == {"kernel"} and all(e["args"]["bytes"] == 16 * 64 * 1024
                                                                    for e in spans)
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    assert flows and Counter(e["ph"] for e in flows)["s"] == Counter(e["ph"] for e in flows)["f"]
    assert len(_spans(doc, "compute")) == 8
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert "compute:model" in tracks and len(tracks) >= 4, "one track per stream (and the device's)"
    json.dumps(doc)   # plain JSON


def test_trace_off_by_default_and_refused() -> None:
    be = SimBackend()
    assert be._sched.trace is None and be._cost is None, "no recorder, no cost model: the default pays nothing"
    with pytest.raises(InvalidTransferError, match="trace=True"):
        be.trace_document()


def _racy(be: SimBackend) -> None:
    layout = KVCacheLayout([PAGE] * 2, [[LayerRef(0, PAGE), LayerRef(1, PAGE)]])
    gpu = [be.empty_device((16, PAGE)) for _ in range(2)]
    with kv.create_worker(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=8) as w:
        spec = GPULoadStoreSpec([1, 2], [2], [0])
        w.submit_store(1, spec, CPULoadStoreSpec([0, 1]))
        w.submit_load(2, CPULoadStoreSpec([2, 3]), spec)   # races with the pending store (R20)
        w.wait({1, 2})


@pytest.mark.rule("R20")
def test_trace_a_dma_race_marks_both_operations() -> None:
    be = SimBackend(trace=True)
    _racy(be)
    assert any(v.kind == "dma_race" for v in be.violations)
    doc = be.trace_document()
    assert check_trace(doc) == []
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["cat"] == "violation"]
    assert {m["name"] for m in marks[:2]} == {"dma_race: store job 1", "dma_race: load job 2"}
    assert len({m["tid"] for m in marks[:2]}) == 2, "on both operations' tracks"
    assert marks[0]["args"]["operations"] == ["store job 1", "load job 2"]


def test_trace_faults_fired_and_work_that_never_ran() -> None:
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=2),
                         kv.Fault("event_query", "error", nth=1, status=999)])
    be = SimBackend(plan, trace=True)
    stream, event = be.create_stream(), be.create_event()
    buf = be.alloc_descriptors(1)
    be.record(event, stream, tag=("load", 2))
    be.copy_batch(stream, buf, 0, tag=("load", 2))
    with pytest.raises(kv.DeviceError):
        be.query(event)
    doc = be.trace_document()
    faults = [e["name"] for e in doc["traceEvents"] if e["ph"] == "i" and e["cat"] == "fault"]
    assert faults == ["fault: hang after load job 2", "fault: event_query error 999"]
    assert [e["name"] for e in _spans(doc, "stuck")] == ["load job 2 (never ran)"]
    assert check_trace(doc) == []


def test_trace_demo_and_example_write_a_trace(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    assert cli.main(["demo", "--trace", str(out)]) == 0
    doc = load_trace(str(out))
    assert check_trace(doc) == []
    processes = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert len(processes) == 11 and processes[0].startswith("act 1")  # act 4: two devices; act 5: six ranks
    assert {p.split(":")[0] for p in processes} == {f"act {n}" for n in range(1, 6)}
    assert any(e["ph"] == "i" and e["name"].startswith("dma_race") for e in doc["traceEvents"])
    step = tmp_path / "step.json"
    assert _example().main(["--profile", "h200", "--trace", str(step)]) == 0
    assert check_trace(load_trace(str(step))) == [] and "0 violation(s)" in capsys.readouterr().out


def test_trace_merge_keeps_flow_ids_unique() -> None:
    be = SimBackend(trace=True)
    _racy(be)
    doc = be.trace_document()
    merged = merge([("sim", doc), ("again", doc)])
    assert check_trace(merged) == []
    assert {e["pid"] for e in merged["traceEvents"]} == {1, 2}


class _Events:
    """A stand-in CUDA runtime: each record happens 1 ms after the previous one."""

    CUDARuntimeError = RuntimeError

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.created, self.destroyed, self._clock = 0, 0, 0.0

    def getDevice(self) -> int:
        return 0

    def eventCreateWithFlags(self, flags: int) -> int:
        self.created += 1
        return 0x100 + self.created

    def eventRecord(self, event: int, stream: int) -> None:
        self.at[event] = self._clock
        self._clock += 1.0

    def eventSynchronize(self, event: int) -> None:
        assert event in self.at

    def eventElapsedTime(self, start: int, end: int) -> float:
        return self.at[end] - self.at[start]

    def eventDestroy(self, event: int) -> None:
        self.destroyed += 1


def test_trace_cupy_tracer_places_copies_by_their_events() -> None:
    rt = _Events()
    cuda = CudaCalls.__new__(CudaCalls)
    cuda.rt, cuda.device, cuda.errors = rt, 0, (RuntimeError,)
    tracer = CupyTracer(cuda, "cupy fake")
    first = tracer.begin(0xA0)
    tracer.end(first, 0xA0, ("store", 3), 1 << 20, 16, "kernel")
    second = tracer.begin(0xB0)
    tracer.end(second, 0xB0, None, 4096, 1, "memcpy")
    doc = tracer.document()
    assert check_trace(doc) == []
    spans = _spans(doc, "copy")
    assert [(s["name"], s["ts"], s["dur"]) for s in spans] == [("store job 3", 1000.0, 1000.0),
                                                              ("copy", 3000.0, 1000.0)]
    assert spans[0]["args"] == {"bytes": 1 << 20, "descriptors": 16, "path": "kernel",
                                "gbps": round((1 << 20) / 1e-3 / 1e9, 4)}
    assert spans[0]["tid"] != spans[1]["tid"], "one track per stream"
    tracer.close()
    assert rt.destroyed == rt.created == 5


def test_trace_cupy_backend_traces_copy_batch_on_the_fake_runtime() -> None:
    fakes = pytest.importorskip("tests.test_backends_cupy")
    from kvoffload_ref.backends import cupy as cb

    backend = cb.CupyBackend(copy_path="memcpy", _cupy_module=fakes.fake_cupy())
    backend.start_trace()
    dev = backend.from_host(np.arange(4 * 64, dtype=np.uint8).reshape(4, 64))
    g = backend.array_info(dev)
    host = np.zeros((4, 64), np.uint8)
    backend.track_host(host.ctypes.data, host.nbytes)
    backend.host_register(host.ctypes.data, host.nbytes)  # page-locked: copy_batch refuses pageable memory (R11)
    buf = backend.alloc_descriptors(4)
    buf.fill(g.ptr + np.arange(4, dtype=np.int64) * g.row_stride, host.ctypes.data + np.arange(4) * 64,
             np.full(4, 64, np.int64))
    stream = backend.create_stream()
    try:
        backend.copy_batch(stream, buf, 4, tag=("store", 7))
        doc = backend.trace_document()
        assert check_trace(doc) == []
        assert [(s["name"], s["args"]["path"], s["args"]["bytes"]) for s in _spans(doc, "copy")] == \
            [("store job 7", "memcpy", 256)]
    finally:
        backend.stop_trace()
        backend.destroy_stream(stream)
        backend.free_descriptors(buf)
        backend.host_unregister(host.ctypes.data)
        backend.untrack_host(host.ctypes.data)
    assert backend.ledger.live() == {}


def test_trace_plot_renders_a_png(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    be = SimBackend(trace=True)
    _racy(be)
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    be.write_trace(str(trace))
    assert cli.main(["trace-plot", str(trace), str(png), "--title", "racy"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_trace_plot_without_matplotlib_prints_one_hint(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".", maxsplit=1)[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli.main(["trace-plot", str(tmp_path / "t.json"), str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install" in err[0] and "matplotlib" in err[0]


def test_trace_cupy_backend_gives_back_the_start_event_of_a_failed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A submission that raises leaves no span and no stranded start event (it is destroyed, not kept)."""
    fakes = pytest.importorskip("tests.test_backends_cupy")
    from kvoffload_ref.backends import cupy as cb

    backend = cb.CupyBackend(copy_path="memcpy", _cupy_module=fakes.fake_cupy())
    backend.start_trace()
    tracer = backend._tracer
    assert tracer is not None
    begun: list[int] = []
    abandoned: list[int] = []
    begin = tracer.begin
    monkeypatch.setattr(tracer, "begin", lambda stream: begun.append(begin(stream)) or begun[-1])
    monkeypatch.setattr(tracer, "abandon", abandoned.append)

    def refuse(*args: object) -> None:
        raise kv.DeviceError("memcpy refused", 1)

    monkeypatch.setattr(backend._engine, "memcpy", refuse)
    dev = backend.from_host(np.zeros((2, 64), np.uint8))
    g = backend.array_info(dev)
    host = np.zeros((2, 64), np.uint8)
    backend.track_host(host.ctypes.data, host.nbytes)
    backend.host_register(host.ctypes.data, host.nbytes)  # page-locked: copy_batch refuses pageable memory (R11)
    buf = backend.alloc_descriptors(2)
    buf.fill(g.ptr + np.arange(2, dtype=np.int64) * g.row_stride, host.ctypes.data + np.arange(2) * 64,
             np.full(2, 64, np.int64))
    stream = backend.create_stream()
    try:
        with pytest.raises(kv.DeviceError):
            backend.copy_batch(stream, buf, 2, tag=("store", 8))
        assert abandoned == begun and len(begun) == 1
        assert _spans(backend.trace_document(), "copy") == []
    finally:
        backend.stop_trace()
        backend.destroy_stream(stream)
        backend.free_descriptors(buf)
        backend.host_unregister(host.ctypes.data)
        backend.untrack_host(host.ctypes.data)


# ------------------------------------------------------------- the host's polling; demo --trace, one panel per act
def test_trace_host_polling_is_a_track_of_its_own() -> None:
    """The clock moves only when the host sleeps: those sleeps (and the polls between them) are drawn on the host's
    track, one span per run of sleeps with its polls counted, never on a device stream's."""
    from kvoffload_ref.backends.trace_format import HOST_TRACK

    be = SimBackend(trace=True)
    stream, event = be.create_stream(), be.create_event()
    be.record(event, stream)
    be.sleep(0.001)
    be.query(event)
    be.sleep(0.002)
    doc = be.trace_document()
    tracks = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    host = [e for e in doc["traceEvents"] if e.get("cat") == "host"]
    assert [(tracks[e["tid"]], e["ph"], e["ts"], e["dur"], e["args"]["polls"]) for e in host] == \
        [(HOST_TRACK, "X", 0.0, pytest.approx(3000.0), 2)]
    assert check_trace(doc) == []
    be.destroy_event(event)
    be.destroy_stream(stream)


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kvoffload_ref.demo import demo

    path = tmp_path_factory.mktemp("demo") / "demo.json"
    assert demo(trace=str(path)) == 0
    return load_trace(str(path))


def test_trace_demo_draws_every_act_in_a_panel_of_its_own(demo_trace: dict[str, Any]) -> None:
    """demo --trace: five panels, one per act (act 5's six ranks included), each with its own time unit; stores and
    loads on lanes named so; the host's polling on its own lanes, after the device's."""
    from kvoffload_ref.trace_plot import panels

    drawn = panels(demo_trace)
    assert [p.title.split(":")[0] for p in drawn] == ["act 1", "act 2", "act 3", "act 4", "act 5"]
    assert [p.unit for p in drawn] == ["ms", "s", "s", "us", "us"]
    act5 = drawn[4]
    assert sum("TP=4 rank" in label and "store stream" in label for label in act5.labels) == 4
    assert sum("TP=2 rank" in label and "load stream" in label for label in act5.labels) == 2
    for panel in drawn:
        lanes = panel.labels[:panel.host_from]
        assert any("store stream (" in label for label in lanes) and any("load stream (" in label for label in lanes)
        assert not any("host" in label for label in lanes), panel.title
        assert panel.labels[panel.host_from:] and all("host: polling" in label for label in
                                                      panel.labels[panel.host_from:]), panel.title


def test_trace_demo_png_has_a_panel_per_act(demo_trace: dict[str, Any], tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    from kvoffload_ref.trace_plot import plot

    png = tmp_path / "demo.png"
    assert plot(demo_trace, str(png)) > 200
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
