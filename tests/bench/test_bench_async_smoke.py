"""bench_async end to end on loopback: its own functions, a tiny run, real outputs.

No testbed (no root): `LocalRunner` runs the bench's jobs on its hand-made
plans with workers on loopback. The emulated run: `python -m tests.bench.bench_async`
as root.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import bench_async as ba

pytestmark = pytest.mark.integration

DEVICES = ("s0", "s1")
"""Two stages (two layers each): fewer processes to start than the bench's four."""


def test_pure_parts_read_metrics_and_build_plans() -> None:
    metrics = [
        {"round": -1, "eval_accuracy": 0.1, "time": 100.0},
        {"round": 0, "loss": 2.0, "round_s": 9.0, "time": 101.0},
        {"round": 1, "loss": 1.0, "round_s": 1.0, "time": 102.0},
        {"round": 2, "loss": 0.5, "round_s": 3.0, "time": 103.0},
        {"round": 2, "eval_accuracy": 0.95, "time": 104.5},
    ]
    rate, rounds = ba.samples_per_s(metrics, 32)
    assert rounds == [9.0, 1.0, 3.0] and rate == pytest.approx(32 / 2.0)
    times, accs = ba.accuracy_curve(metrics)
    assert times == [0.0, 4.5] and accs == [0.1, 0.95]
    assert ba.time_to(times, accs, 0.9) == 4.5 and ba.time_to(times, accs, 0.99) is None
    plan = ba.plan_for(DEVICES, 4)
    assert [s["devices"][0]["device"] for s in plan["stages"]] == list(DEVICES)
    assert [(s["start"], s["end"]) for s in plan["stages"]] == [(0, 2), (2, 4)]
    assert plan["global_batch"] == ba.MICRO * 4
    four = ba.plan_for(ba.STAGE_DEVICES, 4)["stages"]
    assert [(s["start"], s["end"]) for s in four] == [(i, i + 1) for i in range(ba.LAYERS)]
    agg = [c for c in ba.accuracy_configs() if c.aggregate_every]
    k0 = ba.k0(ba.LAYERS, ba.ACC_WINDOW)
    assert agg and agg[0].aggregate_every % k0 == 0 and agg[0].aggregate_every <= ba.ACC_WINDOW
    assert k0 < ba.ACC_WINDOW  # forwards on stale versions: async differs from a scaled sync


def test_a_tiny_run_writes_every_output(tmp_path: Path, redis_url: str) -> None:
    runner = ba.LocalRunner(redis_url, tmp_path / "logs", timeout_s=45)
    sync, asy = ba.throughput_configs()[:2]
    try:
        runs = ba.throughput_part(runner, DEVICES, rounds=3, reps=1, configs=[sync, asy])
        agg = [c for c in ba.accuracy_configs(len(DEVICES)) if c.aggregate_every]
        runs += ba.accuracy_part(runner, DEVICES, rounds=4, eval_every=2, configs=agg)
    finally:
        runner.forget()
    assert [r.note for r in runs] == ["", "", ""]
    for r in runs:
        assert r.samples_per_s is not None and r.samples_per_s > 0, r
        assert len(r.rounds_s) >= 3
    acc = runs[-1]
    assert acc.part == "accuracy" and acc.aggregate_every > 0
    # baseline, round 2, round 4: parsed from the metrics stream, in time order
    assert len(acc.accuracies) == 3 and all(0.0 <= a <= 1.0 for a in acc.accuracies)
    assert acc.times[0] == 0.0 and acc.times == sorted(acc.times) and acc.times[-1] > 0
    header = {"command": "smoke", "k0": ba.k0(len(DEVICES), ba.WINDOW)}
    ba.write_outputs(tmp_path / "out", header, runs)
    for name in ("table.md", "results.json", "throughput.png", "accuracy.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["config"] for r in data["throughput"]} == {"sync M=4", "async M=4"}
    assert all(r["median"] > 0 for r in data["throughput"])
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| sync M=4 | sync | 4 |" in table and "async+agg" in table


@pytest.mark.slow
def test_every_configuration_runs_on_loopback(tmp_path: Path, redis_url: str) -> None:
    runner = ba.LocalRunner(redis_url, tmp_path / "logs", timeout_s=120)
    try:
        runs = ba.throughput_part(runner, DEVICES, rounds=3, reps=1)
        runs += ba.accuracy_part(runner, DEVICES, rounds=10, eval_every=5)
    finally:
        runner.forget()
    assert all(r.samples_per_s for r in runs), [r.note for r in runs]
    names = {c.name for c in ba.throughput_configs() + ba.accuracy_configs(len(DEVICES))}
    assert {r.config for r in runs} == names
