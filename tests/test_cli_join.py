"""`asteroid join`: its command lines, its address check and what it says when a child ends."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from services.cli import app
from services.cli.join import check_accelerator, check_address, child_commands, outcome


def start(service: str) -> list[str]:
    """How the fake installation starts a service."""
    return ["python", f"bin/asteroid-{service}"]


def test_both_children_get_the_coordinator_and_key_set_and_no_redis_url() -> None:
    keys = Path("keys")
    cmds = child_commands(start, "tcp://10.0.0.2:5555", keys, "nano-1", "2GB", 4, profiler=True)
    assert cmds == {
        "worker": [
            *start("worker"),
            *("--coordinator", "tcp://10.0.0.2:5555", "--keys", "keys"),
            *("--memory-budget", "2GB", "--device", "nano-1", "--threads", "4"),
        ],
        "profiler": [
            *start("profiler"),
            *("--serve", "--coordinator", "tcp://10.0.0.2:5555", "--keys", "keys"),
            *("--memory-budget", "2GB"),
        ],
    }
    assert not any("redis" in arg for cmd in cmds.values() for arg in cmd)


def test_both_children_compute_on_the_accelerator_join_was_given() -> None:
    cmds = child_commands(start, "tcp://h:5555", None, None, None, None, True, "cuda")
    for name in ("worker", "profiler"):
        assert cmds[name][-2:] == ["--accelerator", "cuda"], name


def test_an_unknown_accelerator_is_a_usage_error() -> None:
    assert check_accelerator("cpu") == "cpu" and check_accelerator(None) is None
    with pytest.raises(typer.BadParameter, match="'tpu' is not one of auto, cpu, cuda"):
        check_accelerator("tpu")


def test_defaults_are_left_to_the_children() -> None:
    cmds = child_commands(start, "tcp://h:5555", None, None, None, None, profiler=False)
    assert cmds == {"worker": [*start("worker"), "--coordinator", "tcp://h:5555"]}


@pytest.mark.parametrize(
    "address", ["tcp://10.0.0.2:5555", "tcp://coord.lan:1", "tcp://[::1]:5555"]
)
def test_coordinator_addresses_are_accepted(address: str) -> None:
    assert check_address(address) == address


@pytest.mark.parametrize(
    "address", ["10.0.0.2:5555", "tcp://10.0.0.2", "tcp://h:0", "tcp://h:70000", "http://h:1"]
)
def test_other_addresses_are_refused(address: str) -> None:
    with pytest.raises(typer.BadParameter, match="is not a coordinator address"):
        check_address(address)


def test_a_bad_address_is_a_one_line_usage_error() -> None:
    res = CliRunner().invoke(app, ["join", "10.0.0.2:5555"], env={"COLUMNS": "300"})
    assert res.exit_code == ExitCode.CONFIG
    assert "is not a coordinator address" in res.output
    assert "Traceback" not in res.output


def test_a_worker_the_coordinator_shut_down_ends_join_cleanly() -> None:
    assert outcome("worker", 0).exit_code == ExitCode.OK


@pytest.mark.parametrize(
    ("name", "code", "want", "says"),
    [
        ("worker", 2, 2, "the worker exited with code 2"),
        ("profiler", 0, 0, "the profiler exited with code 0"),
        ("profiler", 3, 3, "the profiler exited with code 3"),
        ("worker", -signal.SIGKILL, ExitCode.FAILED, "the worker was killed by SIGKILL"),
    ],
)
def test_a_child_that_ends_is_named(name: str, code: int, want: int, says: str) -> None:
    result = outcome(name, code)
    assert says in result.message
    assert result.exit_code == (want or ExitCode.FAILED)
