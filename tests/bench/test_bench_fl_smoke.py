"""The FL benchmark's code path on a tiny run, checked against the simulator called directly."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from common.fl.data import load_digits_split
from services.federation.simulate import SimConfig, SlowDown, simulate
from services.federation.strategies import make_strategy
from tests.bench.bench_fl import QUICK, Run, main, run_bench, summarize, time_to
from tests.bench.fl_regimes import (
    BATCH,
    LOCAL_STEPS,
    REGIMES,
    STRATEGIES,
    regime_rows,
    winners,
)

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


def _run(scenario: str, strategy: str, seed: int, curve: list[tuple[float, float]]) -> Run:
    times, accs = tuple(t for t, _ in curve), tuple(a for _, a in curve)
    events = ((1.0, 0, "drop", None),) if strategy == "ecofl" else ()
    return Run(scenario, seed, strategy, times, accs, events, accs[-1], accs[-1], None, 0.0)


def test_regime_rows_take_medians_over_the_seeds_that_reach_and_rank_by_the_highest_target() -> (
    None
):
    runs = [
        _run("s", "ecofl", 0, [(0.0, 0.1), (2.0, 0.75), (5.0, 0.95)]),
        _run("s", "ecofl", 1, [(0.0, 0.1), (4.0, 0.85)]),
        _run("s", "fedat", 0, [(0.0, 0.1), (1.0, 0.92)]),
        _run("s", "fedat", 1, [(0.0, 0.1), (3.0, 0.5)]),
        _run("s", "fedavg", 0, [(0.0, 0.1), (9.0, 0.91)]),
        _run("s", "fedavg", 1, [(0.0, 0.1), (8.0, 0.93)]),
    ]
    rows = {r.strategy: r for r in regime_rows(runs)}
    assert rows["ecofl"].times == (3.0, 4.5, 5.0) and rows["ecofl"].reached == (2, 2, 1)
    assert rows["ecofl"].regroups == 1.0 and rows["fedat"].regroups == 0.0
    assert rows["fedat"].times == (1.0, 1.0, 1.0) and rows["fedat"].reached == (1, 1, 1)
    assert rows["fedavg"].times == (8.5, 8.5, 8.5) and rows["fedavg"].reached == (2, 2, 2)
    # both seeds to 0.9 beats one seed there, however early
    assert winners(list(rows.values())) == ["- s: **fedavg** wins; order fedavg, fedat, ecofl"]


def test_the_regimes_cli_writes_rows_equal_to_the_simulator_and_warns_for_spread_only(
    tmp_path: Path,
) -> None:
    out = tmp_path / "regimes"
    args = ["--regimes", "clustered,spread", "--alphas", "0.1", "--seeds", "1", "--horizon", "3"]
    assert main([*args, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert (out / "curves.png").stat().st_size > 0
    assert len(data["runs"]) == 2 * len(STRATEGIES)
    spread = REGIMES["spread"]
    plain = simulate(
        make_strategy("fedasync", 2),
        SimConfig(
            round_times=spread.round_times,
            slowdowns=(SlowDown(spread.slow_home, 1.5, 4.0),),
            dirichlet_alpha=0.1,
            local_steps=LOCAL_STEPS,
            batch_size=BATCH,
            seed=0,
            updates=100,
        ),
    )
    got = next(r for r in data["runs"] if r["strategy"] == "fedasync" and "spread" in r["scenario"])
    kept = [p for p in plain.curve if p.time <= 3.0]
    assert got["times"] == [p.time for p in kept]
    assert got["accuracies"] == pytest.approx([p.accuracy for p in kept])
    text = (out / "results.md").read_text()
    assert "clustered, alpha=0.1, seed 0, groups [(0, 1, 2), (3, 4, 5)]: none" in text
    assert "spread, alpha=0.1, seed 0, groups [(0, 1, 2), (3, 4)]: Eco-FL cannot hold" in text
