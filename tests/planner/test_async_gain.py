"""The predicted gain of async without a drain: hand-computed schedules, the textbook bubble."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import PlanError
from common.plan import Plan
from services.planner.async_gain import StageCost, predict, predict_plan
from tests.planner.fixtures import make_cost, make_profile


def test_an_unbalanced_pipeline_by_hand() -> None:
    # s0: F0 [0,1] F1 [1,2]; s1: F0 [1,3] B0 [3,5] F1 [5,7] B1 [7,9]; s0: B0 [5,6] B1 [9,10]
    gain = predict([StageCost(1.0, 1.0), StageCost(2.0, 2.0)], 2)
    assert gain.sync_window_s == 10.0
    assert gain.async_window_s == 8.0  # 2 x stage 1's 4 s, no fill or drain
    assert gain.bottleneck == 1
    assert gain.sync_bubble == pytest.approx(1 - 2 * 4 / 10)  # stage 1 idles 2 s of 10
    assert gain.speedup == pytest.approx(1.25) and gain.pays


def test_steps_end_the_sync_window_and_updates_pace_async() -> None:
    # balanced, f 1, b 2: (M + S - 1) x 3 = 15, then stage 0 (last to finish) steps 0.5
    stages = [StageCost(1.0, 2.0, step_s=0.5, update_s=0.25)] * 2
    gain = predict(stages, 4)
    assert gain.sync_window_s == 15.5
    assert gain.async_window_s == 4 * 3.25
    assert gain.sync_bubble == pytest.approx(1 - 12 / 15.5)


@pytest.mark.parametrize(("s", "m"), [(2, 4), (4, 4), (4, 16), (4, 64), (3, 1)])
def test_balanced_stages_have_the_textbook_bubble(s: int, m: int) -> None:
    gain = predict([StageCost(0.25, 0.5)] * s, m)
    assert gain.sync_window_s == pytest.approx((m + s - 1) * 0.75)
    assert gain.sync_bubble == pytest.approx((s - 1) / (m + s - 1))
    assert gain.speedup == pytest.approx((m + s - 1) / m)
    assert gain.speedup == pytest.approx(1 / (1 - gain.sync_bubble))  # free updates


def test_expensive_updates_make_async_lose_at_many_micro_batches() -> None:
    stages = [StageCost(1.0, 1.0, step_s=0.5, update_s=0.5)] * 4
    assert predict(stages, 4).pays  # (4 + 3) x 2 + 0.5 = 14.5 against 4 x 2.5 = 10
    many = predict(stages, 64)  # 134.5 against 160
    assert not many.pays and "keep sync" in many.describe()


def test_a_planned_pipeline_uses_its_profiles_and_links() -> None:
    cost = make_cost({"a": 1.0, "b": 2.0}, profile=make_profile(layers=2, f=1.0, b=1.0))
    plan = Plan.model_validate(
        {
            "global_batch": 2,
            "microbatches": 2,
            "stages": [
                {"start": 0, "end": 1, "devices": [{"device": "a"}]},
                {"start": 1, "end": 2, "devices": [{"device": "b"}]},
            ],
        }
    )
    gain = predict_plan(plan, cost, [0.0, 0.0], [0.0, 0.0])
    # the hand-made case, links (4 KiB at 1e18 B/s) all but free
    assert gain.sync_window_s == pytest.approx(10.0) and gain.async_window_s == 8.0
    with pytest.raises(PlanError, match="as many step and update costs"):
        predict_plan(plan, cost, [0.0], [0.0])
    group = Plan.model_validate(
        {
            "global_batch": 2,
            "microbatches": 2,
            "stages": [{"start": 0, "end": 2, "devices": [{"device": "a"}, {"device": "b"}]}],
        }
    )
    with pytest.raises(PlanError, match="single-device stages"):
        predict_plan(group, cost, [0.0], [0.0])


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        StageCost(-1.0, 1.0)
    with pytest.raises(ValueError, match="at least 1"):
        predict([StageCost(1.0, 1.0)], 0)
    with pytest.raises(ValueError, match="at least one stage"):
        predict([], 4)


def test_asteroid_plan_states_what_async_would_gain_on_a_pipeline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from common.ports import free_port
    from services.cli import app
    from services.cli.example_files import example_path

    monkeypatch.setenv("ASTEROID_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with example_path("cluster.yaml") as path:
        args = ["plan", "--cluster", str(path), "--global-batch", "64", "--microbatches", "4"]
        piped = CliRunner().invoke(app, [*args, "--planner", "gpipe"])
        grouped = CliRunner().invoke(app, [*args, "--planner", "dp"])
    assert piped.exit_code == 0, piped.output
    assert "mode async, no drain" in piped.output and "M=4: sync window" in piped.output
    assert grouped.exit_code == 0, grouped.output
    assert "mode async" not in grouped.output  # one data-parallel group: sync only
