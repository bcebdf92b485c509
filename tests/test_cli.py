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
