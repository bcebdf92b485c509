from __future__ import annotations

import yaml
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from services.cli import app
from tests.deploy.fixtures import key_set

runner = CliRunner()


def test_a_bad_inventory_is_one_line_and_exit_config(tmp_path):
    inv = tmp_path / "devices.yaml"
    inv.write_text(
        yaml.safe_dump(
            {
                "cluster": "lab",
                "coordinator_host": "10.0.0.1",
                "devices": [
                    {"name": "c", "host": "h", "roles": ["control", "worker"], "memory": "1GiB"}
                ],
            }
        )
    )
    for cmd in ("up", "status", "down"):
        out = runner.invoke(app, ["deploy", cmd, "--inventory", str(inv), "--keys", str(tmp_path)])
        assert out.exit_code == ExitCode.CONFIG, out.output
        lines = out.output.strip().splitlines()
        assert len(lines) == 1
        assert lines[0].startswith(f"error: inventory {inv}: device c: cpus: required but missing")


def test_a_bad_tag_and_env_lines(tmp_path):
    inv = tmp_path / "devices.yaml"
    device = {"name": "c", "host": "h", "roles": ["control", "worker"], "memory": "1GiB", "cpus": 1}
    inv.write_text(
        yaml.safe_dump({"cluster": "lab", "coordinator_host": "10.0.0.1", "devices": [device]})
    )
    args = ["--inventory", str(inv), "--keys", str(tmp_path / "keys")]
    out = runner.invoke(app, ["deploy", "up", *args, "--tag", "1+x"])
    assert out.exit_code == ExitCode.CONFIG and "image tag '1+x'" in out.output
    key_set(tmp_path / "keys", workers=("c",))
    out = runner.invoke(app, ["deploy", "env", *args])
    assert out.exit_code == 0, out.output
    lines = dict(line.removeprefix("export ").split("=", 1) for line in out.output.splitlines())
    assert lines["ASTEROID_COORDINATOR"] == "tcp://10.0.0.1:5555"
    assert lines["ASTEROID_REDIS_URL"].startswith("redis://operator:")
    assert lines["ASTEROID_REDIS_URL"].endswith("@10.0.0.1:6379/0")
    assert lines["ASTEROID_CLUSTER"] == "lab"
