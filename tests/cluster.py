"""A local cluster of real OS processes for integration tests.

Workers and the coordinator run as `python -m services...` children with
their logs in files; every child is registered so a session fixture kills
leftovers even when a test fails half-way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

_CHILDREN: list[subprocess.Popen[bytes]] = []


def kill_all() -> None:
    """Kill every child any test started (idempotent)."""
    for proc in _CHILDREN:
        if proc.poll() is None:
            proc.kill()
    for proc in _CHILDREN:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    _CHILDREN.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """Coordinator + workers on loopback, sharing one Redis key prefix."""

    def __init__(self, tmp: Path, redis_url: str, cluster: str, heartbeat_s: float = 0.3) -> None:
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
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _CHILDREN.append(proc)
        self.procs[name] = proc
        return proc

    def start_workers(self, names: list[str], faults: dict[str, list[str]] | None = None) -> None:
        """Start one worker per name; `faults` maps a name to `tests.faulty_worker` flags."""
        faults = faults or {}
        for name in names:
            module = "tests.faulty_worker" if name in faults else "services.worker.main"
            self._spawn(name, ["-m", module, *faults.get(name, []), "--device", name])

    def write(self, name: str, data: Any) -> Path:
        path = self.tmp / name
        path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
        return path

    def start_coordinator(
        self, job: dict[str, Any], plan: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        return self._spawn(
            "coordinator",
            [
                "-m",
                "services.coordinator.main",
                "--bind",
                self.addr,
                "--job",
                str(self.write("job.yaml", job)),
                "--plan",
                str(self.write("plan.json", plan)),
                "--shutdown-workers",
            ],
        )

    def run(self, job: dict[str, Any], plan: dict[str, Any], timeout_s: float = 240) -> int:
        """Run a job to the end; returns the coordinator's exit code."""
        proc = self.start_coordinator(job, plan)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(
                f"coordinator did not finish in {timeout_s} s:\n{self.log('coordinator')}"
            ) from None

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log(name).splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_workers_exit(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
