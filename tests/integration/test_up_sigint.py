"""Ctrl-C (SIGINT) to `asteroid up` while it trains: every child process is gone within 10 s.

`up` runs as a person runs it, with its embedded Redis. Its descendants are
collected while they are still its children (once it exits they are
re-parented and no longer found below it), and each one, the embedded
redis-server included, must be gone after SIGINT. A marker in the
environment, inherited by everything `up` starts, finds any process that
was missed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from common.exit_codes import ExitCode
from common.store import Store
from tests.cluster import Budget, cmdline, marked_processes

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
MARKER = "ASTEROID_TEST_SIGINT_RUN"


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, with its start time (pids are reused; that is not)."""
    parent: dict[int, int] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parent[int(entry)] = int(fields[1])
            started[int(entry)] = fields[19]
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return {p: started[p] for p in found}


def alive(pid: int, started: str) -> bool:
    """Whether process `pid` that started at `started` still runs (zombies do not)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] != "Z"


def _json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _wait_for(pred, timeout_s: float, what: str, log: Path, up: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert up.poll() is None, f"up exited ({up.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, (
            f"no {what} within {timeout_s:.0f} s:\n{log.read_text()}"
        )
        time.sleep(0.2)


def test_sigint_to_up_during_training_stops_everything(tmp_path, budget: Budget):
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "job_id": "endless",
                "model": {"name": "small_cnn"},
                "global_batch": 32,
                "micro_batch": 8,
                "rounds": 100000,
                "min_workers": 3,
            }
        )
    )
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "services.cli", "up", "--workers", "3", "--job", str(job)]
    # no --redis-url: its own Redis, keeping its data in this test's folder
    cmd += ["--cluster", "sigint", "--logs", str(logs), "--state-dir", str(tmp_path / "redis")]
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    env[MARKER] = tag
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    children: dict[int, str] = {}
    store: Store | None = None
    try:
        found: list[str] = []

        def said_redis() -> bool:
            found[:] = re.findall(r"Redis (redis://\S+),", log.read_text())
            return bool(found)

        _wait_for(said_redis, budget.left(60), "'cluster up' line", log, up)
        store = Store(found[0], "sigint")

        def round_two() -> bool:
            assert store is not None
            return int(store.get_fields("job", "endless").get("round", 0)) >= 2

        _wait_for(round_two, budget.left(150), "round 2", log, up)
        children = descendants(up.pid)
        servers = [p for p in children if "redis-server" in cmdline(p)]
        assert len(servers) == 1, {p: cmdline(p) for p in children}
        assert len(children) >= 7  # redis, coordinator, planner, profiler, 3 workers
        store.close()
        store = None

        t0 = time.monotonic()
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=budget.left(15))
        while any(alive(p, s) for p, s in children.items()) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = {p: cmdline(p) for p, s in children.items() if alive(p, s)}
        assert not left, f"still running {time.monotonic() - t0:.1f} s after SIGINT: {left}"
        assert marked_processes(MARKER, tag) == {}, "processes `up` started outlived it"
        assert code == ExitCode.INTERRUPTED, log.read_text()[-3000:]
        # Redis is gone with the rest: the coordinator's log tells how the job ended
        ends = [
            e.get("state")
            for e in _json_lines(logs / "coordinator.log")
            if e.get("event") == "job state"
        ]
        assert ends and ends[-1] == "cancelled", ends
    finally:
        if store is not None:
            store.close()
        if up.poll() is None:
            up.kill()
            up.wait(timeout=10)
        # `up` is gone, so its children hang below init now: kill them by the pids
        # taken while they were still its children, and whatever else carries the marker
        for pid, started in children.items():
            if alive(pid, started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid in marked_processes(MARKER, tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
