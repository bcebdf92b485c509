"""The loopback chaos backend: every device a real worker process on 127.0.0.1.

The cluster is `tests.cluster.LocalCluster` (coordinator, workers and, for a
job planned by the planner, a profiler and a planner) on a redis-server of its
own with an append-only file (`appendfsync everysec`, as `asteroid up` runs
it), on a port that stays the same across a restart: a Redis SIGKILL loses
what it had not written, and the restart really loads the AOF. Loopback has
no links to cut, so `cut_restore` is not supported.

Devices that join are ready before the job starts, as on the testbed: `spares`
workers named `j1`, `j2`, ... are started first and SIGSTOPped once they are up
(torch imported) and before any coordinator listens, so they register only when
a `join` continues them, while the job runs. Starting one from nothing then
would take longer (imports on a loaded machine) than a short run lasts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from common.embedded_redis import EmbeddedRedis
from common.ids import DeviceId
from common.messages import DrainDevice
from services.cli.client import ask_coordinator
from tests.chaos.backend import KINDS, Kind, require
from tests.cluster import Budget, LocalCluster, tail

DRAIN_TIMEOUT_S = 15.0
SPARE_READY_S = 120.0
"""A spare worker's start (torch imported) on a loaded machine."""


class LoopbackBackend:
    """Coordinator, workers and Redis as local processes (see the module's docstring)."""

    name = "loopback"
    supports: frozenset[Kind] = frozenset(KINDS) - {"cut_restore"}

    def __init__(
        self,
        out: Path,
        cluster: str,
        *,
        heartbeat_s: float = 0.3,
        env: dict[str, str] | None = None,
        budget: Budget | None = None,
        spares: int = 0,
    ) -> None:
        self.out = out
        self.cluster = cluster
        self._heartbeat_s = heartbeat_s
        self._env = env or {}
        self._budget = budget
        self._redis: EmbeddedRedis | None = None
        self._redis_port = 0
        self._redis_starts = 0
        self._local: LocalCluster | None = None
        self._job: dict[str, Any] = {}
        self._plan: dict[str, Any] | None = None
        self._coordinator = "coordinator"
        self._coordinators = 0
        self.redis_url = ""
        self.spares = [f"j{i}" for i in range(1, spares + 1)]

    @property
    def local(self) -> LocalCluster:
        if self._local is None:
            raise RuntimeError("the loopback cluster is not started")
        return self._local

    def start(self, devices: list[str], job: dict[str, Any], plan: dict[str, Any] | None) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        local = LocalCluster(
            self.out, self.redis_url, self.cluster, self._heartbeat_s, self._budget
        )
        local.env.update({"ASTEROID_REPEATS": "1", "ASTEROID_WARMUP": "0"})  # quick profiles
        local.env.update(self._env)
        self._local, self._job, self._plan = local, job, plan
        local.start_workers([*self.spares, *devices])
        if plan is None:  # the planner plans the job, and takes joining devices in
            local.spawn("profiler", ["-m", "services.profiler.main", "--serve"])
            local.spawn("planner", ["-m", "services.planner.service"])
        for name in self.spares:  # up, and stopped before any coordinator listens
            self._until_logged(name, "worker started")
            self.stop(name)
        self._coordinator = "coordinator"
        local.start_coordinator(job, plan, name=self._coordinator)
        self._coordinators = 1

    def close(self) -> list[str]:
        problems = []
        if self._local is not None:
            try:
                self._local.close()
            except AssertionError as exc:
                problems.append(str(exc))
        if self._redis is not None:
            self._redis.__exit__(None, None, None)
            self._redis = None
        return problems

    def coordinator_exit(self, timeout_s: float) -> int | None:
        try:
            return self.local.procs[self._coordinator].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.local.procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def kill(self, device: str) -> None:
        self._signal(device, signal.SIGKILL)
        self.local.procs[device].wait(timeout=10)

    def stop(self, device: str) -> None:
        self._signal(device, signal.SIGSTOP)

    def cont(self, device: str) -> None:
        self._signal(device, signal.SIGCONT)

    def cut_link(self, device: str) -> None:
        require(self, "cut_restore")

    def restore_link(self, device: str) -> None:
        require(self, "cut_restore")

    def join(self, new_device: str) -> None:
        if new_device in self.spares:
            self.cont(new_device)
        else:
            self.local.start_workers([new_device])

    def _until_logged(self, name: str, event: str, timeout_s: float = SPARE_READY_S) -> None:
        end = time.monotonic() + timeout_s
        while not any(e.get("event") == event for e in self.local.log_events(name)):
            if self.local.procs[name].poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{name} did not log {event!r}:\n{self.log_tail(name)}")
            time.sleep(0.1)

    def drain(self, device: str) -> None:
        reply = ask_coordinator(
            self.local.addr, DrainDevice(target=DeviceId(device)), DRAIN_TIMEOUT_S
        )
        if not reply.ok:
            raise RuntimeError(f"drain {device} refused: {reply.error}")

    def kill_coordinator(self) -> None:
        self._signal(self._coordinator, signal.SIGKILL)
        self.local.procs[self._coordinator].wait(timeout=10)

    def start_coordinator(self, resume: bool = True) -> None:
        self._coordinators += 1
        self._coordinator = f"coordinator-{self._coordinators}"
        self.local.start_coordinator(self._job, self._plan, name=self._coordinator, resume=resume)

    def kill_redis(self) -> None:
        if self._redis is not None and self._redis.proc is not None:
            self._redis.proc.kill()  # no shutdown, no final fsync: only the AOF file survives
            self._redis.proc.wait(timeout=10)
        self._redis = None

    def start_redis(self) -> None:
        self._redis_starts += 1
        redis = EmbeddedRedis(port=self._redis_port, state_dir=self.out / "redis")
        self._redis = redis.__enter__()
        self._redis_port = self._redis.port
        self.redis_url = self._redis.url

    def pids(self) -> dict[str, int]:
        out = {}
        proc = self._redis.proc if self._redis is not None else None
        if proc is not None and proc.poll() is None:
            out[f"redis-{self._redis_starts}"] = proc.pid
        if self._local is not None:
            for name, proc in self._local.procs.items():
                if proc.poll() is None:
                    out[name] = proc.pid
        return out

    def log_tail(self, name: str, lines: int = 30) -> str:
        return f"--- {name}.log ---\n{tail(self.out / f'{name}.log', lines)}"

    def coordinator_name(self) -> str:
        """The child name of the coordinator now running (for its log)."""
        return self._coordinator
