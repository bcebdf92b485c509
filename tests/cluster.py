"""A local cluster of real OS processes for integration tests.

Workers and the coordinator run as `python -m services...` children with
their logs in files; every child is registered so a session fixture kills
leftovers even when a test fails half-way. Cleanup always happens, and what
it had to clean up (a child that would not exit) is reported, not hidden.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.ports import free_port

GLOBAL_TIMEOUT_S = 300.0
"""pytest's per-test timeout (pyproject.toml); a test checks that the two agree."""
CLEANUP_MARGIN_S = 30.0
"""Part of that timeout kept for cleanup after a test's last wait."""


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


_CHILDREN: list[_Child] = []


def spawned() -> int:
    """How many children the tests have spawned so far (a mark for `children_report`)."""
    return len(_CHILDREN)


def children_report(since: int, lines: int = 15) -> str:
    """Each child spawned after mark `since`: its exit status and its log's tail.

    Attached to a failed test's report, so that a worker that crashed or never
    joined is seen without re-running the test.
    """
    parts = []
    for child in _CHILDREN[since:]:
        code = child.proc.poll()
        status = "still running" if code is None else f"exit code {code}"
        parts.append(
            f"--- {child.name} (pid {child.proc.pid}, {status}) ---\n{tail(child.log, lines)}"
        )
    return "\n".join(parts)


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file, or a note that there is none."""
    if not path.exists():
        return f"(no log at {path.name})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the child's process group (it leads its own session) if it still runs."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def _reap(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` in all for `procs`; pids of those still running."""
    deadline = time.monotonic() + timeout_s
    stuck = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stuck.append(proc.pid)
    return stuck


def kill_all() -> None:
    """Kill every child any test started; fail naming those a test left running.

    Every test stops its own children, so one still running at the end of the
    session is a leak worth reporting; it is killed first either way.
    """
    children = list(_CHILDREN)
    _CHILDREN.clear()
    leaked = [c for c in children if c.proc.poll() is None]
    for child in leaked:
        _signal_group(child.proc, signal.SIGKILL)
    stuck = _reap((c.proc for c in leaked), 10)
    if stuck:
        raise AssertionError(f"processes {stuck} still run 10 s after SIGKILL")
    if leaked:
        raise AssertionError(
            "tests left these children running (killed now): "
            + "; ".join(f"{c.name} (pid {c.proc.pid}):\n{tail(c.log, 10)}" for c in leaked)
        )


def cmdline(pid: int) -> str:
    """The command line of process `pid` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def marked_processes(variable: str, value: str) -> dict[int, str]:
    """Live processes whose environment has `variable=value`, with their command lines.

    A test puts a variable of its own into what it starts; everything started
    from there inherits it, so this finds them however they were re-parented.
    """
    needle = f"{variable}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            found[int(entry)] = cmdline(int(entry))
    return found


class Budget:
    """What is left of one test's time, so that all its waits together end before pytest's.

    A wait asks for `left(cap)`: at most `cap` seconds, less when the test's
    budget runs out, so a slow test fails with its own message and logs
    instead of being cut off by the global timeout.
    """

    def __init__(self, total_s: float = math.inf) -> None:
        self.total_s = total_s
        self.end = time.monotonic() + total_s

    def left(self, cap_s: float) -> float:
        """Seconds the next wait may take: `cap_s`, or what is left of the budget."""
        return max(0.0, min(cap_s, self.end - time.monotonic()))

    def __str__(self) -> str:
        return f"{self.total_s:.0f} s test budget, {self.left(math.inf):.0f} s left"


class LocalCluster:
    """Coordinator + workers on loopback, sharing one Redis key prefix."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        cluster: str,
        heartbeat_s: float = 0.3,
        budget: Budget | None = None,
    ) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.addr = f"tcp://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "ASTEROID_REDIS_URL": redis_url,
            "ASTEROID_CLUSTER": cluster,
            "ASTEROID_COORDINATOR": self.addr,
            "ASTEROID_HEARTBEAT_S": str(heartbeat_s),
            "ASTEROID_LOG_FORMAT": "json",
            "ASTEROID_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "ASTEROID_DATA_PORT": "0",  # several workers on this machine
            "ASTEROID_LINK_PORT": "0",
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.workers: list[str] = []
        # made at the start of a test; pass the `budget` fixture where the timeout differs
        self.budget = budget or Budget(GLOBAL_TIMEOUT_S - CLEANUP_MARGIN_S)

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        path = self.tmp / f"{name}.log"
        with path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _CHILDREN.append(_Child(name, proc, path))
        self.procs[name] = proc
        return proc

    def start_workers(self, names: list[str], faults: dict[str, list[str]] | None = None) -> None:
        """Start one worker per name; `faults` maps a name to `tests.faulty_worker` flags."""
        faults = faults or {}
        for name in names:
            module = "tests.faulty_worker" if name in faults else "services.worker.main"
            self.spawn(name, ["-m", module, *faults.get(name, []), "--device", name])
            self.workers.append(name)

    def write(self, name: str, data: Any) -> Path:
        path = self.tmp / name
        path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
        return path

    def start_coordinator(
        self,
        job: dict[str, Any],
        plan: dict[str, Any] | None = None,
        *,
        name: str = "coordinator",
        resume: bool = False,
    ) -> subprocess.Popen[bytes]:
        """The coordinator for `job` on `plan`; without one it profiles and plans the job
        itself (a profiler and a planner must run). With `resume`, a coordinator started
        again (child `name`) that picks the job up from Redis."""
        args = ["-m", "services.coordinator.main", "--bind", self.addr, "--shutdown-workers"]
        args += ["--job", str(self.write("job.yaml", job))]
        if plan is not None:
            args += ["--plan", str(self.write("plan.json", plan))]
        if resume:
            args.append("--resume")
        return self.spawn(name, args)

    def run(self, job: dict[str, Any], plan: dict[str, Any], timeout_s: float = 240) -> int:
        """Run a job to the end; returns the coordinator's exit code."""
        self.start_coordinator(job, plan)
        return self.wait("coordinator", timeout_s)

    def wait(self, name: str, timeout_s: float) -> int:
        """The exit code of child `name`; kills it and fails with its log if it runs on.

        The wait is capped by the test's budget.
        """
        proc = self.procs[name]
        limit = self.budget.left(timeout_s)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
            raise AssertionError(
                f"{name} did not exit within {limit:.0f} s ({self.budget}); killed it:\n"
                f"{self.log_tail(name, 60)}"
            ) from None

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of child `name`'s log, headed by its name."""
        return f"--- {name}.log ---\n{tail(self.tmp / f'{name}.log', lines)}"

    def wait_round(self, store: Any, jid: str, done: int, cap_s: float = 120.0) -> None:
        """Wait until job `jid` committed `done` rounds (its record's `round`), within the
        budget and `cap_s`; the coordinator's log tail names what went wrong otherwise."""
        deadline = time.monotonic() + self.budget.left(cap_s)
        while int(store.get_fields("job", jid).get("round", 0)) < done:
            assert time.monotonic() < deadline, self.log_tail("coordinator")
            time.sleep(0.02)

    def log_events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log(name).splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_workers_exit(self, timeout_s: float = 20, names: Iterable[str] | None = None) -> None:
        """Each worker (default: all started) must exit by itself with code 0 within `timeout_s`.

        Workers still running then are killed; either failure is reported with
        the worker's exit code and log tail. Pass `names` to leave out workers
        the test killed itself.
        """
        names = list(self.workers if names is None else names)
        procs = [self.procs[n] for n in names]
        limit = self.budget.left(timeout_s)
        stuck = set(_reap(procs, limit))
        for proc in procs:
            if proc.pid in stuck:
                _signal_group(proc, signal.SIGKILL)
        _reap(procs, 10)
        bad = [
            f"{n}: {'still running, killed' if p.pid in stuck else f'exit code {p.returncode}'}"
            f"\n{self.log_tail(n)}"
            for n, p in zip(names, procs, strict=True)
            if p.pid in stuck or p.returncode != 0
        ]
        if bad:
            raise AssertionError(
                f"workers did not exit cleanly within {limit:.0f} s of their shutdown:\n"
                + "\n".join(bad)
            )

    def close(self, grace_s: float = 15) -> None:
        """Stop every child: SIGTERM, SIGKILL after `grace_s`; fail naming any that needed it.

        A service must stop on SIGTERM; one that ignores it is a bug this
        reports (after killing it, so cleanup is guaranteed either way).
        """
        running = {n: p for n, p in self.procs.items() if p.poll() is None}
        for proc in running.values():
            _signal_group(proc, signal.SIGTERM)
        stuck = set(_reap(running.values(), grace_s))
        for proc in running.values():
            if proc.pid in stuck:
                _signal_group(proc, signal.SIGKILL)
        unkillable = _reap(running.values(), 10)
        if stuck:
            names = [n for n, p in running.items() if p.pid in stuck]
            raise AssertionError(
                f"{names} did not stop within {grace_s:.0f} s of SIGTERM and were killed"
                + (f" (pids {unkillable} survive even SIGKILL)" if unkillable else "")
                + ":\n"
                + "\n".join(self.log_tail(n) for n in names)
            )
