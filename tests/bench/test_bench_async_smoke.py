"""bench_async end to end on loopback: its own functions, a tiny run, real outputs.

No testbed (no root): `LocalRunner` runs the bench's jobs on its hand-made
plans with workers on loopback. The emulated run: `python -m tests.bench.bench_async`
as root.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.planner.async_gain import predict
from tests.bench import async_jobs as aj
from tests.bench import async_report as ar
from tests.bench import async_runs as ars
from tests.bench.async_hetero import extras_for, hetero_part, host_profile, throttle_for
from tests.bench.async_runners import LocalRunner

pytestmark = pytest.mark.integration

DEVICES = ("s0", "s1")
"""Two stages (two layers each): fewer processes to start than the bench's four."""


def test_pure_parts_read_metrics_and_build_plans() -> None:
    dev = {"stage": 0, "forward_s": 0.4, "backward_s": 0.8, "step_s": 0.1}
    warm = {**dev, "forward_s": 99.0}  # the first round is not measured
    metrics: list[dict[str, Any]] = [
        {"round": -1, "eval_accuracy": 0.1, "time": 100.0},
        {"round": 0, "loss": 2.0, "round_s": 9.0, "time": 101.0, "devices": {"a": warm}},
        {"round": 1, "loss": 1.0, "round_s": 1.0, "time": 102.0, "devices": {"a": dev}},
        {"round": 2, "loss": 0.5, "round_s": 3.0, "time": 103.0, "devices": {"a": dev}},
        {"round": 2, "eval_accuracy": 0.95, "time": 104.5},
    ]
    rate, rounds = ars.samples_per_s(metrics, 32)
    assert rounds == [9.0, 1.0, 3.0] and rate == pytest.approx(32 / 2.0)
    assert ars.stage_timings(metrics) == [{k: v for k, v in dev.items() if k != "stage"}]
    (sync,) = ars.stage_costs(ars.stage_timings(metrics), "sync", 4)
    assert (sync.forward_s, sync.backward_s, sync.step_s, sync.update_s) == (0.1, 0.2, 0.1, 0.0)
    (asy,) = ars.stage_costs(ars.stage_timings(metrics), "async", 4)
    assert asy.update_s == pytest.approx(0.025) and asy.step_s == 0.0
    times, accs = ars.accuracy_curve(metrics)
    assert times == [0.0, 4.5] and accs == [0.1, 0.95]
    assert ars.time_to(times, accs, 0.9) == 4.5 and ars.time_to(times, accs, 0.99) is None
    assert ars.phases(metrics, 32, 1, None) == {
        "before": None,
        "throttled": 32 / 3.0,
        "after": None,
    }
    plan = aj.plan_for(DEVICES, 4)
    assert [s["devices"][0]["device"] for s in plan["stages"]] == list(DEVICES)
    assert [(s["start"], s["end"]) for s in plan["stages"]] == [(0, 2), (2, 4)]
    assert plan["global_batch"] == aj.MICRO * 4
    four = aj.plan_for(aj.STAGE_DEVICES, 4)["stages"]
    assert [(s["start"], s["end"]) for s in four] == [(i, i + 1) for i in range(aj.LAYERS)]
    agg = [c for c in aj.accuracy_configs() if c.aggregate_every]
    k0 = aj.k0(aj.LAYERS, aj.ACC_WINDOW)
    assert agg and agg[0].aggregate_every % k0 == 0 and agg[0].aggregate_every <= aj.ACC_WINDOW
    assert k0 < aj.ACC_WINDOW  # forwards on stale versions: async differs from a scaled sync
    assert [c.microbatches for c in aj.throughput_configs()] == [4, 4, 16, 16, 64, 64]
    heavy = aj.throughput_configs(aj.HEAVY_WINDOWS, "heavy ")
    assert [c.name for c in heavy[:2]] == ["heavy sync M=4", "heavy async M=4"]
    assert {c.global_batch // c.microbatches for c in heavy} == {aj.MICRO}  # same micro-batch


def test_the_heavy_set_is_the_same_pipeline_with_heavier_layers() -> None:
    """Both sets of part 1 run one layer per stage on the same four devices; the heavy
    set's layers do far more compute per parameter, as in PipeDream's and FTPipeHD's convs."""
    from common.data import dataset_for
    from common.zoo import ModelSpec, build_model

    light = build_model(ModelSpec.model_validate(aj.MODEL), 0)
    heavy = build_model(ModelSpec.model_validate(aj.HEAVY_MODEL), 0)
    assert len(light.layers) == len(heavy.layers) == aj.LAYERS
    assert heavy.input.shape == (3, 32, 32)
    assert aj.HEAVY_STAGE_DEVICES == aj.STAGE_DEVICES
    stages = aj.plan_for(aj.HEAVY_STAGE_DEVICES, 4)["stages"]
    assert [(s["start"], s["end"]) for s in stages] == [(i, i + 1) for i in range(aj.LAYERS)]
    images, _ = dataset_for(heavy, aj.SEED).batch(torch.arange(aj.MICRO))
    assert tuple(images.shape) == (aj.MICRO, 3, 32, 32)

    def macs_per_param(model: Any, stage: int) -> float:
        x = torch.zeros(1, *model.input.shape)
        for layer in model.layers[:stage]:
            x = layer(x)
        conv = model.layers[stage].conv
        out = conv(x)
        params = sum(p.numel() for p in conv.parameters())
        return float(out[0, 0].numel() * conv.weight[0].numel() * conv.out_channels / params)

    # the second conv (the bottleneck stage): each weight is used at 16x16 positions
    # against 4x4 on digits
    assert macs_per_param(heavy, 1) > 10 * macs_per_param(light, 1)


def test_the_balanced_set_cuts_a_deeper_model_so_that_its_stages_take_about_as_long() -> None:
    """Stage time on its device (the host's profile over the device's quota): the spread
    between stages is far below the one-layer-per-stage plans', where one stage dominates."""
    profile = host_profile(aj.BALANCED_MODEL)
    assert len(profile.layers) == aj.BALANCED_LAYERS
    cpus = {"tx2-0": 0.5, "nano-0": 0.177, "nano-1": 0.177, "nano-2": 0.177}
    _, cuts = extras_for(profile, cpus, {}, None, aj.BALANCED_DEVICES)
    assert cuts[0] == 0 and cuts[-1] == aj.BALANCED_LAYERS and cuts == sorted(set(cuts))
    layer = [profile.time(i, aj.MICRO, "F") + profile.time(i, aj.MICRO, "B") for i in range(20)]
    stage = [
        sum(layer[a:b]) / cpus[d]
        for (a, b), d in zip(itertools.pairwise(cuts), aj.BALANCED_DEVICES, strict=True)
    ]
    assert max(stage) < 1.6 * min(stage)
    assert aj.BALANCED_DEVICES[0] == "tx2-0" and cuts[1] - cuts[0] >= 2


def test_the_report_predicts_from_the_runs_own_timings() -> None:
    t = {"forward_s": 0.4, "backward_s": 0.8, "step_s": 0.1}
    runs = [
        ars.Run("throughput", "sync M=4", "sync", 4, 0, 0, samples_per_s=10.0, stages=[t, t]),
        ars.Run("throughput", "async M=4", "async", 4, 0, 0, samples_per_s=12.0, stages=[t, t]),
    ]
    (row,) = ar.throughput_rows(runs)
    want_sync = predict(ars.stage_costs([t, t], "sync", 4), 4)
    want_async = predict(ars.stage_costs([t, t], "async", 4), 4)
    assert row["predicted_ratio"] == pytest.approx(
        want_sync.sync_window_s / want_async.async_window_s
    )
    assert row["sync_bubble"] == pytest.approx(want_sync.sync_bubble)
    assert row["measured_ratio"] == pytest.approx(1.2)
    assert row["within"] == (abs(1.2 / row["predicted_ratio"] - 1) <= ar.TOLERANCE)


def test_the_heterogeneous_plan_gives_the_faster_device_more_layers() -> None:
    profile = host_profile()
    cpus = {"tx2-0": 0.5, "nano-0": 0.177, "nano-1": 0.177, "nano-2": 0.177}
    extras, cuts = extras_for(profile, cpus, {}, None)
    assert cuts[0] == 0 and cuts[-1] == aj.HETERO_LAYERS and cuts == sorted(set(cuts))
    layer = [profile.time(i, aj.MICRO, "F") + profile.time(i, aj.MICRO, "B") for i in range(8)]
    work = [sum(layer[a:b]) for a, b in itertools.pairwise(cuts)]
    assert work[0] == max(work)  # tx2-0, about 3x a Nano, holds the most work
    assert extras.cluster.device("tx2-0").slowdown == pytest.approx(2.0)
    held = [b - a for a, b in itertools.pairwise(cuts)]
    throttle = throttle_for(cpus, cuts, 8)  # a device with layers to give away
    assert held[aj.HETERO_DEVICES.index(throttle.device)] == max(held) > 1
    assert throttle.cpu == pytest.approx(cpus[throttle.device] * aj.HETERO_CUT)


def test_a_tiny_run_writes_every_output(tmp_path: Path, redis_url: str) -> None:
    runner = LocalRunner(redis_url, tmp_path / "logs", timeout_s=60)
    sync, asy = aj.throughput_configs()[:2]
    heavy = aj.throughput_configs((4,), "heavy ")
    try:
        runs = ars.throughput_part(runner, DEVICES, rounds=3, reps=1, configs=[sync, asy])
        runs += ars.throughput_part(
            runner,
            DEVICES,
            rounds=3,
            reps=1,
            configs=heavy,
            part="heavy",
            model=aj.HEAVY_MODEL,
            data=aj.HEAVY_DATA,
        )
        agg = [c for c in aj.accuracy_configs(len(DEVICES)) if c.aggregate_every]
        runs += ars.accuracy_part(runner, DEVICES, rounds=4, eval_every=2, configs=agg)
    finally:
        runner.forget()
    assert [r.note for r in runs] == ["", "", "", "", ""]
    for r in runs:
        assert r.samples_per_s is not None and r.samples_per_s > 0, r
        assert len(r.rounds_s) >= 3
    assert [len(r.stages) for r in runs[:4]] == [2, 2, 2, 2]  # both stages' timings, each run
    assert [r.part for r in runs[:4]] == ["throughput", "throughput", "heavy", "heavy"]
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for r in runs for t in r.stages)
    acc = runs[-1]
    assert acc.part == "accuracy" and acc.aggregate_every > 0
    # baseline, round 2, round 4: parsed from the metrics stream, in time order
    assert len(acc.accuracies) == 3 and all(0.0 <= a <= 1.0 for a in acc.accuracies)
    assert acc.times[0] == 0.0 and acc.times == sorted(acc.times) and acc.times[-1] > 0
    header = {"command": "smoke", "k0": aj.k0(len(DEVICES), 4)}
    ar.write_outputs(tmp_path / "out", header, runs)
    for name in ("table.md", "results.json", "throughput.png", "accuracy.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [row["set"] for row in data["throughput"]] == ["throughput", "heavy"]
    for row in data["throughput"]:
        assert row["microbatches"] == 4 and row["sync"] > 0 and row["async"] > 0
        assert row["predicted_ratio"] > 0 and 0 < row["sync_bubble"] < 1
    table = (tmp_path / "out" / "table.md").read_text()
    for part in ("throughput", "heavy"):
        assert f"| {ars.THROUGHPUT_SETS[part]} | 4 |" in table
    assert "async+agg" in table


def test_a_heterogeneous_run_may_adapt_and_reports_its_phases(
    tmp_path: Path, redis_url: str
) -> None:
    """The plumbing of part 2 without a throttle (loopback cannot slow a device): the
    coordinator has the plan's costs, the undisturbed run keeps its plan."""
    runner = LocalRunner(redis_url, tmp_path / "logs", timeout_s=90)
    cpus = dict.fromkeys(aj.HETERO_DEVICES, 1.0)
    extras, cuts = extras_for(host_profile(), cpus, {}, None)
    try:
        runs = hetero_part(runner, extras, cuts, rounds=4)
    finally:
        runner.forget()
    assert [r.mode for r in runs] == ["sync", "async"] and [r.note for r in runs] == ["", ""]
    for r in runs:
        assert r.replans == [] and r.phases["before"] and r.phases["cut_round"] is None
    ar.write_outputs(tmp_path / "out", {"command": "smoke"}, runs)
    assert "| sync hetero |" in (tmp_path / "out" / "table.md").read_text()


@pytest.mark.slow
def test_every_configuration_runs_on_loopback(tmp_path: Path, redis_url: str) -> None:
    runner = LocalRunner(redis_url, tmp_path / "logs", timeout_s=120)
    try:
        runs = ars.throughput_part(runner, DEVICES, rounds=3, reps=1)
        runs += ars.accuracy_part(runner, DEVICES, rounds=10, eval_every=5)
    finally:
        runner.forget()
    assert all(r.samples_per_s for r in runs), [r.note for r in runs]
    names = {c.name for c in aj.throughput_configs() + aj.accuracy_configs(len(DEVICES))}
    assert {r.config for r in runs} == names
