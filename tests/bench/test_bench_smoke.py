"""The transport benchmark runs end to end (quick mode) and writes its outputs."""

import csv
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_quick_transport_benchmark_writes_table_csv_and_plot(tmp_path):
    out = tmp_path / "transport"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_transport", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    with (out / "transport.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["bench"] for r in rows} == {"throughput", "allreduce"}
    assert (out / "transport.png").stat().st_size > 0
    assert "ratio" in (out / "transport.md").read_text()
