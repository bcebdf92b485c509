import pytest
import yaml
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from services.cli import app
from tests.integration.test_planner_service import synthetic_profile


def _files(tmp_path, memory):
    prof = tmp_path / "synthetic.json"
    prof.write_text(synthetic_profile().model_dump_json())
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {
                "devices": [
                    {"name": n, "memory_bytes": memory, "profile": "synthetic", "slowdown": s}
                    for n, s in (("a", 1.0), ("b", 2.0), ("c", 1.0))
                ],
                "bandwidth": 50e6,
            }
        )
    )
    return prof, cluster


def test_plan_prints_plan_comparison_and_draws_timeline(tmp_path):
    prof, cluster = _files(tmp_path, 1 << 30)
    png, out = tmp_path / "t.png", tmp_path / "plan.json"
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "--cluster",
            str(cluster),
            "--global-batch",
            "32",
            "--microbatches",
            "4",
            "--profile",
            str(prof),
            "--compare",
            "--timeline",
            str(png),
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "asteroid plan" in res.output and "planners side by side" in res.output
    assert png.stat().st_size > 10_000 and '"planner": "asteroid"' in out.read_text()


def test_plan_that_fits_nowhere_exits_with_config_code(tmp_path):
    prof, cluster = _files(tmp_path, 1 << 20)
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "--cluster",
            str(cluster),
            "--global-batch",
            "32",
            "--microbatches",
            "4",
            "--profile",
            str(prof),
        ],
    )
    assert res.exit_code == ExitCode.CONFIG
    assert "error" in res.output


def test_report_ratio_is_measured_over_simulated_throughput(redis_url, cluster_name):
    # A job on one device: 8 layers of make_profile (per layer and sample 2^-10 s
    # forward, 2^-9 s backward), 4-sample micro-batches, M = 2, so the simulated
    # round is 2 x 8 x 4 x 3 x 2^-10 s = 0.1875 s (no pipeline, no all-reduce):
    # 8 samples / 0.1875 s. Measured: the median of what the coordinator recorded
    # per steady round (samples_per_s), the first two rounds left out as warm-up.
    from rich.console import Console

    from common.profile import ClusterSpec, DeviceSpec
    from common.store import Store
    from services.cli.report import WARM_UP_ROUNDS, job_report, summary_table
    from tests.planner.fixtures import make_plan, make_profile

    store = Store(redis_url, cluster_name)
    store.put_json(make_profile().model_dump(mode="json"), "profile", "p")
    cluster = ClusterSpec(devices=[DeviceSpec(name="solo", memory_bytes=1 << 30, profile="p")])
    store.put_json(cluster.model_dump(mode="json"), "cluster", "j")
    plan = make_plan([(0, 8, {"solo": 4})], 8, 2).model_copy(update={"planner": "asteroid"})
    store.put_json(plan.model_dump(mode="json"), "plan", "j")
    for r, round_s in enumerate([2.0, 1.5, 0.3, 0.2, 0.25]):
        record = {
            "round": r,
            "loss": 1.0 / (r + 1),
            "round_s": round_s,
            "samples_per_s": 8 / round_s,
        }
        store.append("metrics", "j", {**record, "devices": {}})
        if r == 2:
            store.append("metrics", "j", {"round": r, "eval_loss": 0.5, "eval_accuracy": 0.5})

    steady = [m for m in store.read("metrics", "j") if "loss" in m][WARM_UP_ROUNDS:]
    measured = sorted(m["samples_per_s"] for m in steady)[len(steady) // 2]  # 8 / 0.25
    expected = measured / (8 / 0.1875)  # 0.75

    rep = job_report(store, "j")
    assert rep.sim is not None
    assert rep.sim.round_s == 0.1875
    assert rep.measured_samples_per_s / rep.sim.throughput == pytest.approx(expected)
    console = Console(width=200, record=True)
    console.print(summary_table(rep))
    rows = dict(
        (cells[0].strip(), cells[1].strip())
        for line in console.export_text().splitlines()
        if (cells := [c for c in line.split("│") if c.strip()]) and len(cells) == 2
    )
    assert rows["measured samples/s"] == "32.0"
    assert rows["simulated samples/s"] == "42.7"
    assert rows["measured / simulated"] == f"{expected:.2f}" == "0.75"
