"""The FL benchmark's code path on a tiny run, checked against the simulator called directly."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from common.fl.data import load_digits_split
from services.federation.simulate import SimConfig, simulate
from services.federation.strategies import make_strategy
from tests.bench.bench_fl import QUICK, Run, main, run_bench, summarize, time_to

TINY = replace(QUICK, horizon=12.0, seeds=(0,), slow_seeds=(0,), local_steps=3)


@pytest.fixture(scope="module")
def runs() -> list[Run]:
    return run_bench(TINY, log=False)


def test_bench_curves_equal_the_simulator_cut_at_the_horizon(runs: list[Run]) -> None:
    data = load_digits_split(seed=0)
    for strategy in TINY.strategies:
        plain = simulate(
            make_strategy(strategy, TINY.groups),
            SimConfig(
                round_times=TINY.round_times,
                dirichlet_alpha=TINY.alphas[0],
                local_steps=TINY.local_steps,
                updates=30,  # past the horizon for both strategies
                seed=0,
            ),
            data,
        )
        assert plain.curve[-1].time > TINY.horizon
        kept = [p for p in plain.curve if p.time <= TINY.horizon]
        run = next(r for r in runs if r.strategy == strategy and r.scenario == "alpha=0.5")
        assert run.times == tuple(p.time for p in kept)
        assert run.accuracies == tuple(p.accuracy for p in kept)
        assert run.final_accuracy == kept[-1].accuracy
        want = next((p.time for p in kept if p.accuracy >= TINY.target), None)
        assert run.time_to_target == want
    fedavg = next(r for r in runs if r.strategy == "fedavg" and r.scenario == "alpha=0.5")
    assert fedavg.times == (0.0, 6.0, 12.0)  # synchronous rounds paced by the 6 s home


def test_the_slow_home_moves_in_ecofl_and_the_table_has_every_cell(runs: list[Run]) -> None:
    slow = [r for r in runs if r.scenario.endswith("slows 4x")]
    assert {r.strategy for r in slow} == {"ecofl", "fedavg"}
    eco = next(r for r in slow if r.strategy == "ecofl")
    moved = [(t, h, a) for t, h, a, _ in eco.events if h == TINY.slow_home]
    assert moved and all(t >= TINY.horizon / 2 and a in ("move", "drop") for t, _, a in moved)
    rows = summarize(runs)
    assert {(s.scenario, s.strategy) for s in rows} == {(r.scenario, r.strategy) for r in runs}
    assert all(0.0 <= s.final_mean <= 1.0 and s.runs == 1 for s in rows)


def test_time_to_target_is_the_first_crossing() -> None:
    assert time_to((0.0, 1.0, 2.0, 3.0), (0.1, 0.85, 0.7, 0.9), 0.8) == 1.0
    assert time_to((0.0, 1.0), (0.1, 0.2), 0.8) is None


def test_cli_writes_table_json_and_plot(tmp_path: Path) -> None:
    assert main(["--quick", "--horizon", "7", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| alpha=0.5 | ecofl |" in md and "| alpha=0.5 | fedavg |" in md
    assert "time to 80%" in md and "Eco-FL regroup events" in md
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["horizon"] == 7.0
    assert {r["strategy"] for r in data["runs"]} == {"ecofl", "fedavg"}
    assert (tmp_path / "curves.png").stat().st_size > 0
