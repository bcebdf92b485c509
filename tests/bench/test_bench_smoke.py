"""The transport benchmark runs end to end (quick mode) and writes its outputs."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    """One quick run for every test here: its output directory and its CSV rows."""
    out = tmp_path_factory.mktemp("bench") / "transport"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_transport", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    with (out / "transport.csv").open() as f:
        return out, list(csv.DictReader(f))


def test_quick_transport_benchmark_writes_table_csv_and_plot(quick_run):
    out, rows = quick_run
    assert {r["bench"] for r in rows} == {
        "throughput",
        "allreduce",
        "throughput-curve",
        "allreduce-curve",
    }
    assert (out / "transport.png").stat().st_size > 0
    assert "ratio" in (out / "transport.md").read_text()


def test_quick_transport_benchmark_compares_curve_with_plain_side_by_side(quick_run):
    """CURVE rows: stream at 1 and 32 MiB, the all-reduce at every size and ring size,
    each against our plain path measured in the same run; a plot and a cost summary."""
    out, rows = quick_run
    plain = {
        (r["bench"], r["procs"], r["size_bytes"]): r for r in rows if "curve" not in r["bench"]
    }
    curve = [r for r in rows if r["bench"].endswith("-curve")]
    stream = {r["size_bytes"] for r in curve if r["bench"] == "throughput-curve"}
    assert stream == {str(1 << 20), str(32 << 20)}
    reduce_plain = {(r["procs"], r["size_bytes"]) for r in rows if r["bench"] == "allreduce"}
    reduce_curve = {(r["procs"], r["size_bytes"]) for r in curve if r["bench"] == "allreduce-curve"}
    assert reduce_curve == reduce_plain
    for r in curve:
        assert r["baseline"] == "plain"
        assert float(r["ours"]) > 0
        assert int(r["samples"]) > 0
        # the baseline is the very median reported as "ours" on the plain row
        twin = plain[r["bench"].removesuffix("-curve"), r["procs"], r["size_bytes"]]
        assert r["baseline_value"] == twin["ours"]
    assert (out / "curve.png").stat().st_size > 0
    assert "CURVE cost" in (out / "transport.md").read_text()


def test_elastic_benchmark_replots_its_table_csv_and_plot_from_its_json(tmp_path: Path) -> None:
    """--replot on made-up runs (no testbed): the verdict compares each run to its fresh plan."""
    import json
    from dataclasses import asdict
    from typing import Any

    from tests.bench.bench_elastic import Run, main

    def run(label: str, after: float, **kw: Any) -> dict[str, Any]:
        rounds = [(n, after) for n in range(1, 13)]
        made = Run(label, f"elastic-{label}", "finished", after=after, by_round=rounds, **kw)
        return asdict(made)

    changed = {"cut_round": 10, "replan_round": 11, "replans": 1, "replayed": 0, "device": "n-3"}
    runs = [
        run("join", 90.0, before=60.0, **changed),
        run("fresh4", 100.0),
        run("drain", 56.0, before=100.0, **changed),
        run("fresh3", 70.0),
    ]
    saved = {"model": "small_cnn", "command": "made up", "load": [1.0, 1.0], "runs": runs}
    (tmp_path / "elastic.json").write_text(json.dumps(saved))
    assert main(["--out", str(tmp_path), "--replot"]) == 0
    md = (tmp_path / "elastic.md").read_text()
    assert "throughput after it 90% of fresh4's" in md
    assert "throughput after it 80% of fresh3's" in md
    with (tmp_path / "elastic.csv").open() as f:
        assert [r["label"] for r in csv.DictReader(f)] == ["join", "fresh4", "drain", "fresh3"]
    assert (tmp_path / "elastic.png").stat().st_size > 0
