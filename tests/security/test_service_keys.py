"""The planner and profiler services refuse a bad `--keys` in one log line, not a traceback.

Each service runs as the real installed entry point in a subprocess (what an
operator starts) with a key set that lacks something it needs: any key set at
all, its own secret key, the coordinator's public key, a key file that parses.
It must exit with `ExitCode.CONFIG` and log one error line naming what is
missing and the `asteroid keys init` command that makes the set. A complete set
is the control: the service's hello reaches a CURVE coordinator socket under
its key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.codec import Limits, recv_message
from common.curve import CurveKeys, create_key_set
from common.exit_codes import ExitCode
from common.messages import ServiceHello
from common.sockets import bind_router

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
"""The virtual environment's scripts ([project.scripts] in pyproject.toml)."""

WAIT_S = 60.0
"""Bound on one service run: start-up (importing torch) and its exit or first hello;
the refused runs, started together, get twice as long in all."""

NOWHERE = "tcp://127.0.0.1:9"
"""A coordinator address nothing answers: a refused start must not need one."""

Breaker = Callable[[Path], None]


def _keys_for(role: str, name: str) -> Breaker:
    def make(root: Path) -> None:
        create_key_set(root, **{role: [name]})

    return make


def _without_coordinator_key(root: Path) -> None:
    create_key_set(root, services=["planner"])
    (root / "coordinator" / "coordinator.key").unlink()


def _corrupt_secret(root: Path) -> None:
    create_key_set(root, services=["planner"])
    (root / "services" / "planner.key_secret").write_text("not a key\n")


def _unreadable(root: Path) -> None:
    create_key_set(root, services=["planner"])
    root.chmod(0)


CASES: dict[str, tuple[Breaker, str]] = {
    "empty dir": (lambda root: root.mkdir(), "service secret key"),
    "missing dir": (lambda root: None, "service secret key"),
    "a file, not a dir": (lambda root: root.write_text("keys\n"), "service secret key"),
    "workers only": (_keys_for("workers", "w1"), "service secret key"),
    "no coordinator key": (_without_coordinator_key, "coordinator.key"),
    "corrupt secret key": (_corrupt_secret, "No public key found"),
    "unreadable dir": (_unreadable, ""),
}
"""How the key set is broken, and what the error line must name besides the command."""

PLANNER_CASES = [
    "empty dir",
    "missing dir",
    "a file, not a dir",
    "no coordinator key",
    "corrupt secret key",
    "unreadable dir",
]
PROFILER_CASES = ["empty dir", "workers only", "no coordinator key", "corrupt secret key"]
"""The profiler shares the path from `--keys` to the exit; a few cases show it is wired."""


def _env() -> dict[str, str]:
    """This environment without `ASTEROID_*` settings, so only the flags configure the service."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}


def _command(service: str, keys: Path) -> list[str]:
    common = ["--keys", str(keys), "--coordinator", NOWHERE, "--log-format", "json"]
    if service == "planner":
        return [str(BIN / "asteroid-planner"), *common]
    return [str(BIN / "asteroid-profiler"), "--serve", *common]


def _error_lines(stderr: str) -> list[dict[str, Any]]:
    """The JSON log lines of level error (anything else on stderr is not a log line)."""
    out = []
    for line in stderr.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("level") == "error":
            out.append(event)
    return out


@dataclass(frozen=True)
class Run:
    """How one refused service ended."""

    returncode: int
    output: str
    errors: list[dict[str, Any]]


def _skipped(case: str) -> bool:
    return case == "unreadable dir" and os.geteuid() == 0  # root reads any directory


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Run]]:
    """Every (service, case) run at once, as each spends seconds importing torch."""
    wanted = [("planner", c) for c in PLANNER_CASES] + [("profiler", c) for c in PROFILER_CASES]
    procs: dict[tuple[str, str], subprocess.Popen[str]] = {}
    roots: list[Path] = []
    runs: dict[tuple[str, str], Run] = {}
    try:
        for service, case in wanted:
            if _skipped(case):
                continue
            root = tmp_path_factory.mktemp("keys") / "set"
            CASES[case][0](root)
            roots.append(root)
            procs[service, case] = subprocess.Popen(
                _command(service, root),
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        deadline = time.monotonic() + 2 * WAIT_S  # all at once on a machine of two cores
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            runs[key] = Run(proc.returncode, out + err, _error_lines(err))
        yield runs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=WAIT_S)
        for root in roots:
            if root.is_dir():
                root.chmod(0o700)  # an unreadable set must still be removable


def _assert_refused(run: Run, names: str) -> None:
    assert "Traceback" not in run.output, run.output
    assert run.returncode == ExitCode.CONFIG, run.output
    assert len(run.errors) == 1, run.output
    assert "cannot start" in run.errors[0]["event"], run.errors[0]
    assert "asteroid keys init" in run.errors[0]["error"], run.errors[0]
    assert names in run.errors[0]["error"], run.errors[0]


@pytest.mark.parametrize("case", PLANNER_CASES)
def test_planner_refuses_a_bad_key_set(refused: dict[tuple[str, str], Run], case: str) -> None:
    if _skipped(case):
        pytest.skip("root reads a directory whatever its mode")
    _assert_refused(refused["planner", case], CASES[case][1])


@pytest.mark.parametrize("case", PROFILER_CASES)
def test_profiler_service_refuses_a_bad_key_set(
    refused: dict[tuple[str, str], Run], case: str
) -> None:
    _assert_refused(refused["profiler", case], CASES[case][1])


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    return tmp_path / "keys"


@pytest.fixture
def coordinator(keydir: Path) -> Iterator[tuple[zmq.Socket[Any], str]]:
    """A CURVE control socket as the coordinator binds it, admitting service keys.

    The set's one service key is "planner": the profiler takes whichever one it finds.
    """
    create_key_set(keydir, services=["planner"])
    ctx: zmq.Context[Any] = zmq.Context()
    keys = CurveKeys.load(keydir, "coordinator")
    sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits(), keys, ("service",))
    try:
        yield sock, endpoint
    finally:
        sock.close(0)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("service", ["planner", "profiler"])
def test_a_complete_key_set_reaches_the_coordinator(
    keydir: Path, coordinator: tuple[zmq.Socket[Any], str], redis_url: str, service: str
) -> None:
    sock, endpoint = coordinator
    args = _command(service, keydir)
    args[args.index(NOWHERE)] = endpoint
    proc = subprocess.Popen(
        [*args, "--redis-url", redis_url],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sock.poll(int(WAIT_S * 1000)), f"no hello from the {service} within {WAIT_S} s"
        _, env = recv_message(sock, Limits(), routed=True)
        assert isinstance(env.msg, ServiceHello)
        assert env.user == "service:planner"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=WAIT_S)
    assert "Traceback" not in out + err, out + err
    assert proc.returncode == ExitCode.OK, out + err
