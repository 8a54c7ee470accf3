"""``kvoffload-ref cost-table``: the table's schema (keys, types, the grid covered, monotonic where the physics
says so), its agreement with the profile's fixed terms, its JSON and CSV forms, and the command line through the
console script in a temporary directory (bad input: a clear message, exit 2)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import json
import pathlib
import subprocess
import sys
from itertools import pairwise
from typing import Any

import pytest

from kvoffload_ref import cost_table
from kvoffload_ref.backends.sim_profiles import H20, H100, MI355X, PROFILES, PROVENANCE, paths_of
from kvoffload_ref.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
KiB = 1024
SIZES, COUNTS, MAX = (4 * KiB, 64 * KiB), (1, 16, 64), 1024 * 1024
ROW_TYPES = {"direction": str, "path": str, "size_bytes": int, "count": int, "time_s": float, "gbps": float,
             "fixed_s": float, "per_descriptor_s": float}
DUPLEX_TYPES = {"path": str, "size_bytes": int, "count": int, "store_alone_s": float, "load_alone_s": float,
                "store_together_s": float, "load_together_s": float, "together_s": float,
                "together_gbps": float, "speedup_vs_serial": float}


@pytest.fixture(scope="module")
def h100_table() -> dict[str, Any]:
    return cost_table.build("h100", sizes=SIZES, counts=COUNTS, max_bytes=MAX)


def _series(table: dict[str, Any]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in table["rows"]:
        out.setdefault((row["direction"], row["path"], row["size_bytes"]), []).append(row)
    return out


def test_cost_table_schema_keys_types_and_grid(h100_table: dict[str, Any]) -> None:
    t = h100_table
    assert set(t) == {"schema_version", "profile", "provenance", "units", "shape", "grid", "rows", "duplex"}
    assert t["schema_version"] == cost_table.SCHEMA_VERSION and t["profile"] == "h100"
    assert t["provenance"]["kind"] == PROVENANCE["h100"].kind == "from published figures"
    assert set(t["provenance"]) == {"kind", "sources", "fitted_on", "assumed"}
    assert t["units"] == {"time": "s", "size": "bytes", "bandwidth": "GB/s (1e9 bytes/s)"}
    assert t["grid"] == {"sizes": list(SIZES), "counts": list(COUNTS), "max_bytes": MAX}
    for row in t["rows"]:
        assert {k: type(v) for k, v in row.items()} == ROW_TYPES, row
    for row in t["duplex"]:
        assert {k: type(v) for k, v in row.items()} == DUPLEX_TYPES, row
    # every (direction, path, size, count) with count x size <= max_bytes, once; 64 x 64 KiB = 4 MiB left out
    cells = [(r["direction"], r["path"], r["size_bytes"], r["count"]) for r in t["rows"]]
    assert sorted(cells) == sorted((d, p, s, c) for d in ("d2h", "h2d") for p in paths_of(H100) for s in SIZES
                                   for c in COUNTS if c * s <= MAX)
    assert ("d2h", "dma", 64 * KiB, 16) in cells and ("d2h", "dma", 64 * KiB, 64) not in cells, "up to max_bytes"
    assert {(r["path"], r["size_bytes"]) for r in t["duplex"]} == {(p, s) for p in paths_of(H100) for s in SIZES}
    json.loads(cost_table.to_json(t))   # JSON-ready as is


def test_cost_table_is_monotonic_where_physics_says_so(h100_table: dict[str, Any]) -> None:
    for key, rows in _series(h100_table).items():
        for a, b in pairwise(rows):
            assert b["time_s"] > a["time_s"], ("more descriptors take longer", key)
            assert b["gbps"] >= a["gbps"], ("the fixed cost amortised", key)
        for row in rows:   # each series is the line through its first and last count (one copy alone)
            assert row["time_s"] == pytest.approx(row["fixed_s"] + row["count"] * row["per_descriptor_s"])
    for row in h100_table["duplex"]:
        assert row["together_s"] == max(row["store_together_s"], row["load_together_s"]), "both done"
        assert row["together_s"] >= max(row["store_alone_s"], row["load_alone_s"]) - 1e-15, row
        assert row["together_s"] <= row["store_alone_s"] + row["load_alone_s"], ("duplex beats serial", row)
        assert 1.0 <= row["speedup_vs_serial"] <= 2.0


def test_cost_table_fixed_cost_is_the_profiles_per_call_terms(h100_table: dict[str, Any]) -> None:
    """The intercept measured on the sim is the call cost, plus the launch on the kernel path (no other fixed
    term): the table reads the cost model, it does not re-derive it."""
    launch = {"memcpy": 0.0, "dma": 0.0, "kernel": H100.kernel.launch if H100.kernel else 0.0}
    for (_, path, _), rows in _series(h100_table).items():
        assert rows[0]["fixed_s"] == pytest.approx(H100.call_cost + launch[path], rel=1e-6), path
        if path == "memcpy":   # every descriptor its own run: one cudaMemcpyAsync each
            assert rows[0]["per_descriptor_s"] > H100.memcpy.per_descriptor


def test_cost_table_mi355x_batched_is_slower_at_64_kib() -> None:
    t = cost_table.build(MI355X, sizes=(64 * KiB,), counts=(1, 256), max_bytes=1 << 30)
    gbps = {r["path"]: r["gbps"] for r in t["rows"] if r["direction"] == "d2h" and r["count"] == 256}
    assert gbps["dma"] < gbps["memcpy"]


def test_cost_table_reports_each_direction_its_own_costs() -> None:
    """Where a profile's source measured the directions apart, so do its rows: h20's large copies load at 54 GB/s
    and store at 50 (kvcached #450: each row's per-descriptor cost is its per-run term plus its bytes at that
    rate); mi355x's batched 256 KiB copies load at ~12.8 and store at ~30 (ROCm/clr #273), and its duplex row's
    store and load alone differ by as much."""
    size = 4 * 1024 * KiB
    h20 = cost_table.build("h20", sizes=(size,), counts=(1, 4), max_bytes=1 << 30)
    rate = {r["direction"]: size / (r["per_descriptor_s"] - H20.memcpy.per_descriptor) / 1e9
            for r in h20["rows"] if r["path"] == "memcpy"}
    assert rate == pytest.approx({"h2d": 54, "d2h": 50}, rel=1e-6)
    mi = cost_table.build(MI355X, sizes=(256 * KiB,), counts=(1, 64), max_bytes=1 << 30)
    gbps = {r["direction"]: r["gbps"] for r in mi["rows"] if r["path"] == "dma" and r["count"] == 64}
    assert gbps["h2d"] == pytest.approx(12.8, rel=0.05) and gbps["d2h"] == pytest.approx(30, rel=0.05), gbps
    (duplex,) = [r for r in mi["duplex"] if r["path"] == "dma"]
    assert duplex["load_alone_s"] / duplex["store_alone_s"] == pytest.approx(30 / 12.8, rel=0.05)


def test_cost_table_csv_has_one_row_per_cell(h100_table: dict[str, Any]) -> None:
    text = cost_table.to_csv(h100_table)
    rows = list(csv.DictReader(io.StringIO(text)))
    assert tuple(rows[0]) == cost_table.CSV_COLUMNS and len(rows) == len(h100_table["rows"])
    for got, row in zip(rows, h100_table["rows"], strict=True):
        assert got["profile"] == "h100" and got["provenance_kind"] == "from published figures"
        assert int(got["schema_version"]) == cost_table.SCHEMA_VERSION
        assert (got["direction"], got["path"], int(got["size_bytes"]), int(got["count"])) == \
            (row["direction"], row["path"], row["size_bytes"], row["count"])
        assert float(got["time_s"]) == row["time_s"] and float(got["gbps"]) == row["gbps"], "exact (repr)"


def test_cost_table_bad_input_and_an_unnamed_profile() -> None:
    with pytest.raises(ValueError, match="unknown sim profile"):
        cost_table.build("a100")
    with pytest.raises(ValueError, match="positive ints"):
        cost_table.build("h100", sizes=(0,))
    with pytest.raises(ValueError, match="positive ints"):
        cost_table.build("h100", counts=(True,))
    own = dataclasses.replace(H100, name="mine")
    t = cost_table.build(own, sizes=(4 * KiB,), counts=(1, 2))
    assert t["profile"] == "mine" and t["provenance"] is None
    assert {r["path"] for r in t["rows"]} == set(paths_of(own))
    one = cost_table.build("simple", sizes=(4 * KiB,), counts=(8,))
    assert one["rows"][0]["fixed_s"] is None and one["rows"][0]["per_descriptor_s"] is None, "one count: no line"
    assert cost_table.to_csv(one).splitlines()[1].endswith(",,"), "empty in the CSV"


def _cli(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    script = str(pathlib.Path(sys.executable).parent / "kvoffload-ref")
    return subprocess.run([script, "cost-table", *argv], capture_output=True, text=True, timeout=120, check=False,
                          cwd=cwd)


def test_cost_table_cli_writes_json_and_csv_and_refuses_bad_input(tmp_path: pathlib.Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Through the console script (a JSON file; an unknown profile), and in process for the rest (speed)."""
    small = ["--max-bytes", "16384"]
    done = _cli(["--profile", "mi300x", "--output", "t.json", *small], tmp_path)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    table = json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))
    assert table["profile"] == "mi300x" and table["grid"]["max_bytes"] == 16384
    assert {r["size_bytes"] * r["count"] for r in table["rows"]} <= set(range(16385))
    done = _cli(["--profile", "a100"], tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert "argument --profile: invalid choice: 'a100'" in done.stderr
    assert all(repr(name) in done.stderr for name in PROFILES), "names the choices"
    assert main(["cost-table", "--profile", "gb200", "--format", "csv", *small]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ",".join(cost_table.CSV_COLUMNS)
    assert {line.split(",")[1] for line in out.splitlines()[1:]} == {"gb200"}
    for argv, what in ((["--profile", "h20", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
                       ([], "the following arguments are required: --profile")):
        with pytest.raises(SystemExit) as exited:
            main(["cost-table", *argv])
        assert exited.value.code == 2 and what in capsys.readouterr().err, argv


def test_cost_table_worked_example_reads_rows_and_extends_the_line(tmp_path: pathlib.Path) -> None:
    """docs/examples/cost_table_tier.py (docs/cost-table.md): a count in the grid is read off its row; one past it
    from the series' line, which is what the sim measures for that count; on mi355x it picks a path per direction
    (the doc's output)."""
    spec = importlib.util.spec_from_file_location("_example_cost_table_tier",
                                                  ROOT / "docs" / "examples" / "cost_table_tier.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    table = cost_table.build("mi300x", sizes=(16 * KiB,), counts=(1, 64, 256), max_bytes=8 * 1024 * 1024)
    (row,) = [r for r in table["rows"] if (r["direction"], r["path"], r["count"]) == ("h2d", "dma", 64)]
    assert example.copy_time(table, "h2d", "dma", 16 * KiB, 64) == row["time_s"]
    measured = cost_table.CopyRig(PROFILES["mi300x"], "dma", 16 * KiB, 1024).time("h2d", 1024)
    assert example.copy_time(table, "h2d", "dma", 16 * KiB, 1024) == pytest.approx(measured, rel=1e-9)
    lines = example.report(table)
    assert lines[0] == "mi300x (from published figures)" and len(lines) == 6
    assert "16 blocks (64 x 16 KiB) offload: dma " in lines[1] and lines[1].endswith("GB/s")
    assert "a store and a load together (256 x 16 KiB each, dma)" in lines[5]
    # mi355x at 16 KiB (ROCm/clr #273): batched is cheaper for a store, the per-op loop for a load
    lines = example.report(cost_table.build("mi355x", sizes=(16 * KiB,), counts=(1, 64), max_bytes=8 * 1024 * 1024))
    assert lines[1].endswith(" -> dma, 6.1 GB/s") and lines[2].endswith(" -> memcpy, 5.6 GB/s"), lines
