"""A federation of homes on one machine from one call: `up_homes` (`asteroid up --homes N`).

The shipped federation and home files are fitted to the homes started, with no
edits; two real homes of one worker each run a short federation to its end, the
global model is in Redis, and Ctrl-C stops every process that was started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.job import DigitsData, JobSpec
from common.store import Store
from services.cli.homes import FEDERATION_PREFIX, fitted_files, home_prefix

START_S = 120.0
"""Longest wait for the federation's first lines (N stacks and a Redis starting)."""
FEDERATION_S = 240.0
"""Longest wait for a two-update federation of two homes to finish."""
STOP_S = 60.0
"""Longest wait for everything to stop after Ctrl-C."""


def test_the_examples_are_fitted_to_the_homes_started() -> None:
    spec, jobs = fitted_files(3, "tcp://127.0.0.1:7000", updates=4)
    assert spec["homes"] == 3 and spec["updates"] == 4
    assert [j["job_id"] for j in jobs] == ["home0", "home1", "home2"]
    for h, raw in enumerate(jobs):
        job = JobSpec.model_validate(raw)
        assert job.federation is not None
        assert job.federation.home == h and job.federation.address == "tcp://127.0.0.1:7000"
        assert job.federation.federation_id == spec["federation_id"]
        assert isinstance(job.dataset, DigitsData)
        assert job.dataset.homes == 3 and job.dataset.home == h
    assert home_prefix(1) == "home-1"


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (read from /proc, so nothing extra is needed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_line(proc: subprocess.Popen[str], pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    seen = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


@pytest.mark.integration
def test_two_homes_federate_to_the_end_and_stop_on_ctrl_c(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from services.cli.homes import up_homes; "
        "up_homes(2, 1, 1, Path(sys.argv[1]), None, updates=2, "
        "publish=lambda s: print('published', s.cluster, s.coordinator, flush=True))"
    )
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    started: set[int] = set()
    try:
        _wait_for_line(proc, r"published home-0 tcp://127\.0\.0\.1:\d+$", START_S)
        found = _wait_for_line(proc, r"Redis (redis://\S+?);", START_S)
        store = Store(found.group(1), FEDERATION_PREFIX)
        try:
            deadline = time.monotonic() + FEDERATION_S
            fields: dict[str, object] = {}
            while time.monotonic() < deadline and proc.poll() is None:
                fields = store.get_fields("fl", "digits")
                if fields.get("state") == "finished":
                    break
                time.sleep(1.0)
            assert fields.get("state") == "finished", (fields, proc.poll())
            assert fields["version"] == 2 and fields["homes"] == 2
            model = store.get_blob("fl-model", "digits")
            assert model is not None and len(model) > 1000
        finally:
            store.close()
        for h in range(2):
            assert (tmp_path / "logs" / f"home-{h}.yaml").exists()
            assert (tmp_path / "logs" / home_prefix(h) / "coordinator.log").exists()
        started = _descendants(proc.pid)
        assert len(started) >= 2 * 4 + 2  # Redis, the federation, 2 x (3 services, 1 worker)
        proc.send_signal(signal.SIGINT)
        proc.wait(STOP_S)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.2)
        assert not [p for p in started if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()
