"""`asteroid train` refuses bad job specs before contacting anything."""

import pytest
import yaml
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from common.ports import free_port
from services.cli import app

GOOD = {
    "job_id": "j",
    "model": {"name": "small_cnn"},
    "global_batch": 64,
    "micro_batch": 16,
    "rounds": 3,
}


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"model": {"name": "no_such_net"}}, "model", "no_such_net"),
        ({"micro_batch": 10}, "micro_batch", "global_batch 64 is not a multiple of micro_batch 10"),
        (
            {"dataset": {"kind": "cifar10", "path": "/nonexistent/cifar"}},
            "dataset.path",
            "folder /nonexistent/cifar does not exist",
        ),
        ({"learning_rate": 0.1}, "learning_rate", "unknown key"),
        ({"optimizer": {"kind": "sgd", "lr": -1}}, "optimizer.lr", "greater than 0"),
        ({"planner": "magic"}, "planner", "'magic' is not one of"),
        ({"rounds": 3, "epochs": 1}, "epochs", "give rounds or epochs, not both"),
    ],
)
def test_bad_job_specs_name_the_field_and_start_nothing(tmp_path, change, field, says):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**GOOD, **change}))
    # nothing listens there: an attempt to submit would time out instead
    dead = f"tcp://127.0.0.1:{free_port()}"
    res = CliRunner().invoke(app, ["train", str(path), "--coordinator", dead])
    assert res.exit_code == ExitCode.CONFIG, res.output
    out = " ".join(res.output.split())
    assert f"{field}: " in out and says in out, out
    assert "no coordinator answered" not in out


def test_a_job_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("- just\n- a list\n")
    res = CliRunner().invoke(app, ["train", str(path)])
    assert res.exit_code == ExitCode.CONFIG
    assert "expected a mapping" in " ".join(res.output.split())


def test_an_unreachable_coordinator_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    dead = f"tcp://127.0.0.1:{free_port()}"
    args = ["train", str(path), "--coordinator", dead, "--reply-timeout", "1"]
    res = CliRunner().invoke(app, args, env={})
    assert res.exit_code == ExitCode.UNREACHABLE
    assert f"no coordinator answered at {dead}" in " ".join(res.output.split())


@pytest.mark.parametrize(
    "command", ["demo", "up", "train", "plan", "status", "cancel", "export", "profile"]
)
def test_every_command_has_help(command):
    res = CliRunner().invoke(app, [command, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output or "usage" in res.output
