"""The simulation benchmark runs end to end (quick mode) and writes its outputs."""

import csv
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_quick_simulation_benchmark_writes_table_csv_and_plot(tmp_path):
    out = tmp_path / "simulation"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_simulation", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    with (out / "simulation.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["env"] for r in rows} == {"A", "C"}
    assert {r["model"] for r in rows} == {"mobilenet_v2", "bert_small"}
    assert {r["link_bps"] for r in rows} == {"100000000", "1000000000"}
    assert "optimal" not in {r["planner"] for r in rows}
    assert {"asteroid", "dp", "gpipe"} <= {r["planner"] for r in rows}
    assert all(r["status"] in ("fits", "does not fit", "failed") for r in rows)
    assert any(r["planner"] == "asteroid" and r["status"] == "fits" for r in rows)
    for model in ("mobilenet_v2", "bert_small"):
        assert (out / "profiles" / f"{model}.json").stat().st_size > 0
    md = (out / "simulation.md").read_text()
    assert "python -m tests.bench.bench_simulation --quick" in md
    assert "Asteroid speedup" in md
    assert (out / "simulation.png").stat().st_size > 0
    assert "simulation.{md,csv,png}" in proc.stdout
