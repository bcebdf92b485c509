"""Ctrl-C (SIGINT) to `asteroid up` while it trains: every child process is gone within 10 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from common.exit_codes import ExitCode
from common.store import Store

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children run in their own sessions, not groups)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigint_to_up_during_training_stops_everything(tmp_path, redis_url, cluster_name):
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
    cmd = [sys.executable, "-m", "services.cli", "up", "--workers", "3", "--job", str(job)]
    cmd += ["--redis-url", redis_url, "--cluster", cluster_name, "--logs", str(tmp_path / "logs")]
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    store = Store(redis_url, cluster_name)
    try:
        deadline = time.monotonic() + 180
        while store.get_fields("job", "endless").get("round", 0) < 2:
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        children = descendants(up.pid)
        assert len(children) >= 6  # coordinator, planner, profiler, 3 workers
        t0 = time.monotonic()
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=15)
        while any(alive(p) for p in children) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = [p for p in children if alive(p)]
        assert not left, f"still running {time.monotonic() - t0:.1f} s after SIGINT: {left}"
        assert code == ExitCode.INTERRUPTED
        assert store.get_fields("job", "endless")["state"] == "cancelled"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(timeout=10)
        for p in descendants(up.pid):
            os.kill(p, signal.SIGKILL)
        store.close()
