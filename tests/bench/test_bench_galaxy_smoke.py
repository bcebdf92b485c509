"""bench-galaxy's pure parts, without root or a testbed: OOM marking, predictions, outputs."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from common.errors import ConfigError
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.choose import STEP_LATENCY_S
from services.coordinator.galaxy.cost import memory_bytes, predict
from services.coordinator.galaxy.planner import plan_galaxy, plan_local, plan_megatron
from services.testbed import net
from services.testbed.spec import cluster_spec, preset
from tests.bench import bench_galaxy, galaxy_serve
from tests.bench.galaxy_cells import (
    SEQ_LEN,
    Cell,
    compute_scale,
    device_profiles,
    fitted_step_latency,
    host_profile,
    memory_unaware_plan,
    planning_time_s,
    predicted_s,
    repredict,
    request_ids,
    ring_steps,
    shape,
    split_pays_from,
)
from tests.bench.galaxy_report import ms, speedup, tables, write_charts


def _profile(device: str, per_head: float, per_col: float, per_row: float) -> BlockProfile:
    """A linear profile: seconds proportional to the share, as a compute-bound block's."""
    return BlockProfile(
        device=device,
        seq_len=SEQ_LEN,
        mha=tuple((n, n * per_head) for n in (3, 6, 9, 12)),
        mlp=tuple((n, n * per_col) for n in (768, 1536, 2304, 3072)),
        con=tuple((n, n * per_row) for n in (71, 142, 213, 284)),
    )


def _galaxy_e() -> tuple[list[str], dict[str, float], dict[str, int]]:
    spec = preset("galaxy-e", "125mbit")
    planned = cluster_spec(spec)
    budgets = {d.name: planned.device(d.name).memory_bytes for d in spec.devices}
    return spec.names(), {d.name: d.cpu for d in spec.devices}, budgets


def test_shapes_are_the_papers_models_with_the_asked_layers() -> None:
    d = shape("distilbert", 6)
    assert (d.kind, d.hidden, d.heads, d.ffn, d.layers) == ("encoder", 768, 12, 3072, 6)
    g = shape("gpt2", 3)
    assert (g.kind, g.hidden, g.ln_eps, g.max_positions) == ("decoder", 768, 1e-5, SEQ_LEN)
    assert len(request_ids()) == SEQ_LEN and max(request_ids()) < d.vocab_size
    with pytest.raises(ConfigError, match="unknown model"):
        shape("bert_large", 2)
    assert bench_galaxy.parse_layers("gpt2=4")["gpt2"] == 4
    assert bench_galaxy.parse_layers("")["distilbert"] == 6
    with pytest.raises(ConfigError, match="MODEL=N"):
        bench_galaxy.parse_layers("gpt2=0")


def test_device_profiles_are_the_host_profile_slowed_by_the_cpu_quota() -> None:
    host = _profile("host", 0.01, 1e-5, 1e-5)
    devs = device_profiles(host, {"fast": 2.0, "half": 0.5, "slow": 0.137})
    assert devs["fast"].mha_s(12) == pytest.approx(host.mha_s(12))  # never faster than the host
    assert devs["half"].mlp_s(3072) == pytest.approx(2 * host.mlp_s(3072))
    assert devs["slow"].con_s(284) == pytest.approx(host.con_s(284) / 0.137)
    assert devs["slow"].device == "slow"


def test_sequence_parallelism_is_marked_oom_where_the_whole_model_outgrows_nano_s() -> None:
    names, cpus, budgets = _galaxy_e()
    profiles = device_profiles(_profile("host", 0.01, 4e-5, 1e-5), cpus)
    config = shape("distilbert", 6).config()
    whole = memory_bytes(
        plan_local(config, ["x"], {"x": profiles[names[0]]}, {"x": 1 << 40}, SEQ_LEN), config
    )[0]
    assert whole > budgets["nano-s-0"] and whole < budgets["nano-l-0"]  # the premise, the plain way
    plan, oom = memory_unaware_plan("sp", config, names, profiles, budgets)
    assert plan is not None and plan.mode == "sp"
    assert len(oom) == 1 and oom[0].startswith("nano-s-0 needs")
    for mode in ("galaxy", "megatron", "local"):
        plan, oom = memory_unaware_plan(mode, config, names, profiles, budgets)
        assert plan is not None and oom == [], mode
        assert all(
            m <= budgets[d] for d, m in zip(plan.devices, memory_bytes(plan, config), strict=True)
        )
    plan, _ = memory_unaware_plan("local", config, names, profiles, budgets)
    assert plan is not None and plan.devices == ["nano-l-0"]  # the fastest device that holds it


def test_nothing_fits_one_device_for_the_memory_case_but_galaxy_splits_it() -> None:
    spec = preset("galaxy-d", "125mbit")
    planned = cluster_spec(spec)
    budgets = {d.name: planned.device(d.name).memory_bytes for d in spec.devices}
    profiles = device_profiles(
        _profile("host", 0.01, 4e-5, 1e-5), {d.name: d.cpu for d in spec.devices}
    )
    config = shape("distilbert", 9).config()
    for mode in ("sp", "local"):
        _, oom = memory_unaware_plan(mode, config, spec.names(), profiles, budgets)
        assert oom, mode
    plan, oom = memory_unaware_plan("galaxy", config, spec.names(), profiles, budgets)
    assert plan is not None and not oom
    assert plan.heads[0] > plan.heads[1]  # the faster Nano-L takes more heads


def test_predictions_are_the_cost_models_and_megatron_comm_is_its_ring_allreduce() -> None:
    names, cpus, budgets = _galaxy_e()
    profiles = device_profiles(_profile("host", 0.01, 4e-5, 1e-5), cpus)
    config = shape("bert_small", 4).config()
    plan = plan_megatron(config, names, SEQ_LEN)
    total, comm = predicted_s(plan, config, profiles, 125e6)
    assert total == predict(plan, config, profiles, 125e6, step_latency_s=STEP_LATENCY_S).total_s
    n, tile_bits = 2, SEQ_LEN / 2 * config.hidden * 32
    step = tile_bits / 125e6 + STEP_LATENCY_S  # every ring step's bytes and its fixed cost
    assert comm == pytest.approx(config.layers * 2 * 2 * (n - 1) * step)
    galaxy = plan_galaxy(config, names, profiles, budgets, SEQ_LEN)
    assert predicted_s(galaxy, config, profiles, 125e6)[0] < total


def test_planning_time_is_measured_on_algorithm_1_and_well_under_a_second() -> None:
    _names, cpus, budgets = _galaxy_e()
    profiles = device_profiles(_profile("host", 0.01, 4e-5, 1e-5), cpus)
    seconds = planning_time_s(shape("gpt2", 12).config(), profiles, budgets, repeats=3)
    assert 0 < seconds < 1.0


def test_host_profile_times_the_sizes_the_coordinator_asks_for() -> None:
    tiny = shape("bert_small", 1).config()
    small = type(tiny)("encoder", 1, 16, 2, 32, 50, SEQ_LEN, 1e-12)
    prof = host_profile(small, repeats=1)
    assert [n for n, _ in prof.mha] == [1, 2] and prof.seq_len == SEQ_LEN
    assert all(s >= 0 for _, s in prof.con)


def _cells() -> list[Cell]:
    def ok(mode: str, s: float, pred: float, part: str = "grid", link: float = 125) -> Cell:
        return Cell(part, "galaxy-e", "bert_small", 4, mode, link, "ok", [s], s, pred)

    return [
        ok("galaxy", 0.5, 0.4),
        ok("megatron", 1.0, 0.8),
        Cell("grid", "galaxy-e", "bert_small", 4, "sp", 125, "oom", note="nano-s-0 needs 1 MiB"),
        ok("local", 0.75, 0.7),
        ok("galaxy", 0.2, 0.2, "sweep", 1000),
        ok("galaxy-no-overlap", 0.3, 0.25, "sweep", 1000),
        ok("megatron", 0.25, 0.2, "sweep", 1000),
    ]


def test_tables_show_measured_and_predicted_ms_speedups_and_oom(tmp_path: Path) -> None:
    cells = _cells()
    assert ms(cells[0]) == "500 (400)" and ms(cells[2]) == "OOM"
    assert speedup(cells[0], cells[1]) == "2.00x" and speedup(cells[0], cells[2]) == "OOM"
    text = "\n".join(tables(cells, [{"devices": "4 Nano-M", "model": "gpt2", "seconds": 0.0012}]))
    grid_row = next(
        line for line in text.splitlines() if line.startswith("| galaxy-e | bert_small (4) | 500")
    )
    assert "| 2.00x | OOM | 1.50x | 125 |" in grid_row  # vs megatron, sp, local; ms per layer
    assert "| galaxy-e | bert_small (4) | 1000 | 200 (200) | 300 (250) | 1.50x |" in text
    assert "| 4 Nano-M | gpt2 | 1.20 |" in text
    assert "nano-s-0 needs 1 MiB" in text
    written = write_charts(tmp_path, cells)
    assert [p.name for p in written] == ["latency.png", "sweep.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_the_choice_table_sets_auto_beside_the_best_mode_and_local() -> None:
    cells = _cells()
    auto = Cell("grid", "galaxy-e", "bert_small", 4, "auto", 125, "ok", [0.51], 0.51)
    auto.plan = {"mode": "galaxy", "devices": ["nano-l-0", "nano-s-0"]}
    auto.predicted_dev_s, auto.step_s = 0.459, {"nano-l-0": 0.002}
    cells[0].predicted_dev_s = 0.55
    text = "\n".join(tables([*cells, auto], []))
    assert (
        "| galaxy-e | bert_small (4) | 125 | 510 (459) | galaxy on nano-l-0+nano-s-0 | "
        "500 (550) (galaxy) | 1.02x | 0.68x | 0.67x | 0.90 |"
    ) in text
    assert "2 of 2 predictions within 15 % of the measurement." in text
    assert "| galaxy-e | nano-l-0 | 2.00 |" in text


def test_the_step_latency_fitted_to_a_measured_split_predicts_it_back() -> None:
    names, cpus, budgets = _galaxy_e()
    profiles = device_profiles(_profile("host", 0.01, 4e-5, 1e-5), cpus)
    config = shape("bert_small", 4).config()
    plan = plan_galaxy(config, names, profiles, budgets, SEQ_LEN)
    bare = predict(plan, config, profiles, 125e6).total_s
    cell = Cell("grid", "galaxy-e", "bert_small", 4, "galaxy", 125, "ok", [1.0])
    cell.plan = plan.model_dump(mode="json")
    cell.dev_profiles = {d: p.model_dump(mode="json") for d, p in profiles.items()}
    assert ring_steps(plan, 4) == 16
    cell.median_s = bare + 16 * 0.004
    fitted = fitted_step_latency(cell)
    assert fitted == pytest.approx(0.004)
    repredict(cell, 0.004)
    assert cell.predicted_dev_s == pytest.approx(cell.median_s) and cell.step_latency_s == 0.004
    local = Cell("grid", "galaxy-e", "bert_small", 4, "local", 125, "ok", [0.5], 0.5)
    alone = plan_local(config, names, profiles, budgets, SEQ_LEN)
    local.plan, local.dev_profiles = alone.model_dump(mode="json"), cell.dev_profiles
    assert fitted_step_latency(local) is None  # no ring steps to spread anything over
    alone_s = predict(alone, config, profiles, 125e6).total_s
    local.median_s = 0.5 * alone_s  # the profiles say twice what the device takes
    assert compute_scale(local) == pytest.approx(0.5)
    assert bench_galaxy.env_step_latency([cell, local]) == pytest.approx(
        fitted_step_latency(cell, 0.5)
    )
    assert fitted_step_latency(cell, 0.5) > 0.004  # less compute: more left for the steps


def test_the_split_pays_from_a_faster_link_the_larger_the_fixed_step_cost() -> None:
    profiles = device_profiles(_profile("host", 0.01, 4e-5, 1e-5), {"a": 0.5, "b": 0.5})
    cell = Cell("grid", "galaxy-a", "bert_small", 4, "auto", 125, "ok", [1.0], 1.0)
    cell.dev_profiles = {d: p.model_dump(mode="json") for d, p in profiles.items()}
    cell.step_latency_s = 0.0
    cheap = split_pays_from(cell)
    assert cheap is not None and cheap[2] > 1.1 and "+" in cheap[1]
    cell.step_latency_s = 0.01
    dear = split_pays_from(cell)
    assert dear is None or dear[0] > cheap[0] or dear[2] < cheap[2]
    cell.step_latency_s = 10.0
    assert split_pays_from(cell) is None
    text = "\n".join(tables([cell], []))
    assert "| galaxy-a | bert_small (4) | not up to 10000 | | |" in text


def test_replot_rebuilds_the_report_from_results_json(tmp_path: Path) -> None:
    saved: dict[str, Any] = {
        "command": "python -m tests.bench.bench_galaxy",
        "load": [0.5, 0.7],
        "envs": ["galaxy-e"],
        "link": "125mbit",
        "devices": ["galaxy-e: nano-l-0 0.5 cores 256 MiB"],
        "models": "bert_small 512/8/2048",
        "vocab": 1000,
        "cut": "nothing",
        "planning": [],
        "host_profiles": {},
        "cells": [asdict(c) for c in _cells()],
    }
    (tmp_path / "results.json").write_text(json.dumps(saved))
    assert bench_galaxy.main(["--out", str(tmp_path), "--replot"]) == 0
    report = (tmp_path / "results.md").read_text()
    assert "Bandwidth sweep" in report and "| 2.00x |" in report
    assert (tmp_path / "sweep.png").exists()


def test_a_plan_that_does_not_fit_is_marked_oom_without_touching_the_testbed() -> None:
    names, cpus, budgets = _galaxy_e()
    profiles = device_profiles(_profile("host", 0.01, 4e-5, 1e-5), cpus)
    bed = SimpleNamespace(devices=names)  # any other use of the testbed would raise
    cell = Cell("grid", "galaxy-e", "distilbert", 6, "sp", 125)
    galaxy_serve.serve_cell(bed, None, cell, profiles, budgets, 3, threading.Event())  # type: ignore[arg-type]
    assert cell.state == "oom" and "nano-s-0" in cell.note
    assert cell.predicted_s is not None and cell.median_s is None


def test_set_link_changes_both_ends_of_every_link_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = preset("galaxy-d", "125mbit")
    seen: list[list[str]] = []
    monkeypatch.setattr(net, "run_all", lambda cmds: seen.extend(cmds))
    bed = SimpleNamespace(spec=spec, tag="t1", netem=False, netns=lambda d: f"ns-{d}")
    galaxy_serve.set_link(bed, 50e6)  # type: ignore[arg-type]
    assert len(seen) == 2 * 2 * 3  # devices x ends x (class, queue, drop class)
    assert all("change" in c and "add" not in c for c in seen)
    assert sum("50000000bit" in c for c in seen) == 2 * 2 * 2
    assert {c[2] for c in seen if c[:2] == ["tc", "-n"]} == {"ns-nano-l-0", "ns-nano-m-0"}
    assert next(c for c in seen if c[0] == "tc" and c[1] != "-n")[4] == net.host_veth("t1", 0)
