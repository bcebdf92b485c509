"""The real-homes FL bench's pure parts: its arguments, curves, table and outputs, no root."""

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench.bench_fl_homes import main, parse_args
from tests.bench.fl_homes_report import (
    curve_of,
    fastest,
    load,
    regime,
    regroup_events,
    round_latencies,
    row,
    save,
    since_warmup,
    table,
    time_to,
    warmup_end,
    write_outputs,
)
from tests.bench.fl_homes_setup import (
    HOMES,
    SPEED_RATIO,
    STRATEGIES,
    TARGETS,
    RunResult,
    federation_spec,
    plan_runs,
)


def _entries() -> list[dict[str, Any]]:
    """fl-metrics entries as the federation writes them, with a probe round (same version)."""
    accs = [0.1, 0.45, 0.72, 0.72, 0.81, 0.79, 0.93]
    versions = [0, 1, 2, 2, 3, 4, 5]
    regroups: list[list[list[Any]]] = [[], [], [[1, "drop", None]], [[1, "rejoin", 0]], [], [], []]
    return [
        {
            "time_s": 3.0 * i,
            "version": v,
            "accuracy": a,
            "regroups": r,
            "failed": [],
            "group": -1 if i == 1 else 0,
            "members": [0, 1],
            "latencies": [1.0 + i, 4.0 + 2 * i],
        }
        for i, (v, a, r) in enumerate(zip(versions, accs, regroups, strict=True))
    ]


def _plain_first(entries: list[dict[str, Any]], target: float) -> float | None:
    """The reference: scan every entry, skipping repeats of a version, the plain way."""
    seen: set[int] = set()
    for e in entries:
        if e["version"] in seen:
            continue
        seen.add(e["version"])
        if e["accuracy"] >= target:
            return float(e["time_s"])
    return None


def test_arguments_and_the_runs_they_plan() -> None:
    full = parse_args([])
    assert full.out == Path("bench-results/fl-homes") and full.budget == 40.0
    assert not full.quick and full.deadline == "" and full.alphas == (0.1,)
    assert full.strategies == STRATEGIES
    quick = parse_args(["--quick", "--deadline", "13:45"])
    assert quick.budget == 25.0 and quick.deadline == "13:45"
    assert quick.strategies == ("ecofl", "fedavg")
    assert parse_args(["--quick", "--budget", "30"]).budget == 30.0
    both = parse_args(["--alphas", "0.1,0.5", "--strategies", "fedat,ecofl"])
    assert both.alphas == (0.1, 0.5) and both.strategies == ("fedat", "ecofl")
    for bad in (["--budget", "0"], ["--alphas", "x"], ["--alphas", "0"], ["--strategies", "sgd"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    runs = plan_runs(both.strategies, both.alphas)
    assert [(r.strategy, r.alpha) for r in runs] == [
        ("fedat", 0.1),
        ("ecofl", 0.1),
        ("fedat", 0.5),
        ("ecofl", 0.5),
    ]
    assert all(r.slowdown for r in runs) and len({r.label for r in runs}) == len(runs)


def test_the_regime_is_eco_fls_and_every_strategy_gets_the_same_band() -> None:
    cores = [c for h in HOMES for _, _, c in h.devices]
    assert SPEED_RATIO == max(cores) / min(cores) >= 4
    specs = [federation_spec(s, "digits", 10) for s in STRATEGIES]
    band = {(s["rt_fraction"], s["latency_window"], s["regroup_dwell"]) for s in specs}
    assert len(band) == 1 and {s["strategy"] for s in specs} == set(STRATEGIES)
    from common.fl.spec import FederationSpec

    for s in specs:
        FederationSpec.model_validate(s)


def test_curve_drops_probe_rounds_and_times_to_target_match_a_plain_scan() -> None:
    entries = _entries()
    times, accs, versions = curve_of(entries)
    assert versions == [0, 1, 2, 3, 4, 5]
    assert times == [0.0, 3.0, 6.0, 12.0, 15.0, 18.0]
    for target in (0.05, 0.7, 0.8, 0.9, 0.95):
        assert time_to(times, accs, target) == _plain_first(entries, target)
    assert time_to(times, accs, 0.95) is None
    assert regroup_events(entries) == [(6.0, 1, "drop", None), (9.0, 1, "rejoin", 0)]
    lats = round_latencies(entries)
    assert len(lats) == 2 * (len(entries) - 1) and (3.0, 0, 2.0) not in lats  # warm-up out
    assert lats[:2] == [(0.0, 0, 1.0), (0.0, 1, 4.0)]


def test_times_count_from_the_warm_up_rounds_end() -> None:
    entries = _entries()
    assert warmup_end(entries) == 3.0
    after = since_warmup(entries)
    assert [e["time_s"] for e in after] == [3.0 * i - 3.0 for i in range(1, len(entries))]
    assert [e["version"] for e in after] == [e["version"] for e in entries[1:]]
    assert since_warmup([e for e in entries if e["group"] != -1]) == []


def test_regime_measures_speed_ratio_and_noise_against_a_plain_computation() -> None:
    lats = [(float(t), h, (1.0 + h) * (1.1 if t % 2 else 0.9)) for t in range(6) for h in range(5)]
    lats.append((10.0, 0, 50.0))  # after the throttle: left out
    got = regime(lats, 10.0)
    assert got["ratio"] == pytest.approx(5.0) and got["fastest"] == pytest.approx(1.0)
    assert got["noise"] == pytest.approx(0.1)
    assert regime(lats[:3], None)["ratio"] is None  # a home without rounds


def test_table_rows_from_a_fake_curve() -> None:
    entries = _entries()
    r = RunResult("ecofl", 0.5, True, state="budget")
    r.times, r.accuracies, r.versions = curve_of(entries)
    r.regroups = regroup_events(entries)
    cells = row(r)
    for t in TARGETS:
        assert cells[f"t{int(t * 100)}"] == _plain_first(entries, t)
    assert cells["final"] == entries[-1]["accuracy"]
    assert cells["best"] == max(e["accuracy"] for e in entries)
    assert cells["updates"] == 5 and cells["regroups"] == 2 and cells["first_s"] == 3.0
    lines = table([r, RunResult("fedavg", 0.1, False, state="skipped")])
    assert len(lines) == 4
    assert lines[2] == (
        "| ecofl | 0.5 | yes | 3 | 6 | 12 | 18 | 0.930 | 0.930 | 5 | 2 | 18 | - | - | budget |"
    )
    assert lines[3] == (
        "| fedavg | 0.1 | no | - | - | - | - | - | - | 0 | 0 | - | - | - | skipped |"
    )
    slow = RunResult("fedat", 0.5, True, times=[0.0, 20.0], accuracies=[0.1, 0.95])
    never = RunResult("astraea", 0.5, True, times=[0.0], accuracies=[0.1])
    assert fastest([never, slow, r], 0.5, 0.9) == ["ecofl", "fedat", "astraea"]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_outputs_and_replot_from_results_json(tmp_path: Path) -> None:
    entries = _entries()
    r = RunResult("fedat", 0.5, True, slowed_at_s=9.0)
    r.times, r.accuracies, r.versions = curve_of(entries)
    r.regroups = regroup_events(entries)
    r.latencies = round_latencies(entries)
    other = RunResult("fedavg", 0.1, False, times=[0.0, 4.0], accuracies=[0.1, 0.75])
    other.versions = [0, 1]
    header = {"command": "x", "wan": "20mbit", "budget": 60, "updates": 10}
    save(tmp_path, header, [r, other])
    saved_header, runs = load(tmp_path)
    assert saved_header == header
    assert runs[0].regroups == r.regroups and runs[1].accuracies == [0.1, 0.75]
    assert runs[0].latencies == r.latencies
    write_outputs(tmp_path, saved_header, runs)
    md = (tmp_path / "results.md").read_text()
    assert "| fedat | 0.5 | yes | 3 | 6 | 12 | 18 |" in md
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "results.md").unlink()
    assert main(["--out", str(tmp_path), "--replot"]) == 0
    assert (tmp_path / "results.md").read_text() == md
    assert json.loads((tmp_path / "results.json").read_text())["runs"][1]["alpha"] == 0.1
