"""`asteroid testbed up|down|status`: exit codes, and what status and down report."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from services.cli import app
from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec
from tests.testbed.traces import traces

MiB = 1 << 20


@pytest.mark.parametrize("args", [["up"], ["down"], ["status"]])
def test_every_command_needs_root(monkeypatch, args):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    res = CliRunner().invoke(app, ["testbed", *args])
    assert res.exit_code == ExitCode.CONFIG, res.output
    assert "needs root" in res.output


def test_up_refuses_a_bad_testbed_file_before_creating_anything(monkeypatch, tmp_path):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    bad = tmp_path / "bed.yaml"
    bad.write_text("name: x\ndevices: []\n")
    res = CliRunner().invoke(app, ["testbed", "up", "--file", str(bad)])
    assert res.exit_code == ExitCode.CONFIG
    assert "devices" in res.output
    res = CliRunner().invoke(app, ["testbed", "up", "--preset", "env-q"])
    assert res.exit_code == ExitCode.CONFIG
    assert "unknown testbed preset" in res.output
    res = CliRunner().invoke(app, ["testbed", "up", "--preset", "env-a", "--file", str(bad)])
    assert res.exit_code == ExitCode.CONFIG
    res = CliRunner().invoke(app, ["testbed", "up", "--subnet", "8.8.8.0/24"])
    assert res.exit_code == ExitCode.CONFIG
    assert "--subnet" in res.output and "private" in res.output


@pytest.mark.integration
def test_status_shows_a_testbed_and_down_removes_it(tmp_path, subnet, tag):
    spec = TestbedSpec.model_validate(
        {
            "name": "cli",
            "subnet": subnet,
            "devices": [
                {"name": "one", "cpu": 0.3, "memory_bytes": 400 * MiB, "bandwidth_bps": 2e7},
                {"name": "two", "cpu": 0.2, "memory_bytes": 400 * MiB, "bandwidth_bps": 1e8},
            ],
        }
    )
    tb = Testbed(spec, tmp_path, tag=tag)
    try:
        tb.up(services=False)
        tb.start("one", "sleeper", ["sleep", "600"])
        res = CliRunner().invoke(app, ["testbed", "status"], env={"COLUMNS": "250"})
        assert res.exit_code == 0, res.output
        for text in (tag, "one", "two", "20Mbit", "100Mbit", "0.3", "400 MiB", "sleep 600"):
            assert text in res.output, text
        # as after a crash: the Testbed object is gone, `down` works from the names
        res = CliRunner().invoke(app, ["testbed", "down", "--tag", tag])
        assert res.exit_code == 0, res.output
        for text in (f"namespace ae-{tag}-one", f"link aebr-{tag}", "process", "cgroup"):
            assert text in res.output, text
        assert traces(tag) == []
        res = CliRunner().invoke(app, ["testbed", "down", "--tag", tag])
        assert "nothing to remove" in res.output
    finally:
        tb.down()
