"""The Duan & Wu benchmark runs end to end (quick mode); its figures agree with plain references."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.planner.cost import CostModel
from tests.bench.bench_duanwu import GIB, STEADY, model_profile
from tests.planner.fixtures import hetero_cost

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One quick run for every test here: its output directory and its JSON."""
    out = tmp_path_factory.mktemp("bench") / "duanwu"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_duanwu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out, json.loads((out / "results.json").read_text())


def test_writes_table_json_and_plot(quick_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = quick_run
    assert (out / "duanwu.png").stat().st_size > 0
    text = (out / "results.md").read_text()
    assert "brute force" in text
    assert "5.7 %" in text
    assert data["fig7"]
    assert data["depth4"]


def test_brute_force_is_never_beaten(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = quick_run
    for row in data["fig7"]:
        best = row["brute_bound_s"]
        for field in ("alg2_bound_s", "initial_bound_s", "sorting_bound_s"):
            assert row[field] >= best * (1 - 1e-6), (field, row)
        assert row["alg2_bound_s"] <= row["initial_bound_s"] * (1 + 1e-9)


def plain_period(cost: CostModel, cuts: list[int], micro: int) -> float:
    """Longest stage forward + backward (and boundary transfer), summed layer by layer."""
    worst = 0.0
    for p, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        prof = cost.profile(f"w{p}")
        step = sum(prof.time(i, micro, "F") + prof.time(i, micro, "B") for i in range(lo, hi))
        worst = max(worst, step)
        if hi < cost.num_layers:
            nbytes = prof.layers[hi - 1].output_bytes * micro
            worst = max(worst, cost.cluster.latency_s + nbytes / cost.cluster.bandwidth)
    return worst


def test_depth4_figures_match_plain_references(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = quick_run
    micro = data["config"]["micro"]
    for row in data["depth4"]:
        devs = [(f"w{i}", 1.0, 8 * GIB) for i in range(4)]
        cost = hetero_cost(devs, model_profile(row["model"]), bandwidth=row["bandwidth_Bps"])
        period = plain_period(cost, row["cuts"], micro)
        assert row["bound_s"] == pytest.approx(period, rel=1e-9)
        # at the optimal beta the full pipeline advances one micro-batch per bound
        assert row["beta_opt_period_s"] == pytest.approx(period, rel=1e-6)
        # at beta = 1/2 the slower phase takes twice its whole-device time
        half = 0.0
        for p, (lo, hi) in enumerate(itertools.pairwise(row["cuts"])):
            prof = cost.profile(f"w{p}")
            f = sum(prof.time(i, micro, "F") for i in range(lo, hi))
            b = sum(prof.time(i, micro, "B") for i in range(lo, hi))
            half = max(half, 2 * f, 2 * b)
        assert row["beta_half_period_s"] == pytest.approx(max(half, period), rel=1e-6)
        assert row["beta_opt_round_s"] <= row["beta_half_round_s"]
        assert row["microbatches"] < STEADY
