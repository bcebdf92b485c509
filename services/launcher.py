"""A whole cluster on this machine: Redis, the four services and N workers, as processes.

Used by `asteroid up` and `asteroid demo`. Every service is started exactly
as a person would start it on a device (its installed command, such as
`asteroid-worker`, with flags and `ASTEROID_*` variables; never
`python -m`, which a folder named `common` or `services` in the current
folder would shadow), logs to its own file, and is stopped on exit, on
error and on Ctrl-C; children also die with this process.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import TracebackType

from common.embedded_redis import EmbeddedRedis
from common.entry_points import service_command
from common.errors import AsteroidError
from common.ports import free_port
from common.procs import spawn, stop_all

__all__ = ["LocalStack", "ServiceDied", "check_alive", "log_tail", "service_env"]


class ServiceDied(AsteroidError):
    """A service of the local stack exited on its own; the message has its log's tail."""


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a process's log file ("(no log)" when it has none)."""
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def check_alive(name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Raise ServiceDied naming `name`, with its log's tail, if `proc` has exited."""
    code = proc.poll()
    if code is not None:
        raise ServiceDied(f"{name} exited with code {code}:\n{log_tail(log)}")


def service_env(
    redis_url: str, cluster: str, coordinator: str, heartbeat_s: float, threads: int
) -> dict[str, str]:
    """The caller's environment plus what every service of a local cluster is told."""
    return {
        **os.environ,
        "ASTEROID_REDIS_URL": redis_url,
        "ASTEROID_CLUSTER": cluster,
        "ASTEROID_COORDINATOR": coordinator,
        "ASTEROID_HEARTBEAT_S": str(heartbeat_s),
        "ASTEROID_LOG_FORMAT": "json",
        "OMP_NUM_THREADS": str(threads),
        "ASTEROID_DATA_PORT": "0",  # several workers on this machine
        "ASTEROID_LINK_PORT": "0",
    }


class LocalStack:
    """Redis (embedded unless `redis_url`), coordinator, planner, profiler, `workers` workers."""

    def __init__(
        self,
        workers: int,
        log_dir: Path,
        redis_url: str | None = None,
        cluster: str = "local",
        threads: int = 1,
        memory_budget: int = 0,
        heartbeat_s: float = 0.5,
    ) -> None:
        self.workers, self.log_dir = workers, log_dir
        self.cluster, self.threads = cluster, threads
        self.memory_budget, self.heartbeat_s = memory_budget, heartbeat_s
        self._url = redis_url
        self.coordinator = f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._redis: EmbeddedRedis | None = None

    @property
    def redis_url(self) -> str:
        """The Redis every service uses (the embedded one once started)."""
        if self._url is None:
            raise AsteroidError("the local stack has not started its Redis yet")
        return self._url

    @property
    def devices(self) -> list[str]:
        """Names of the workers."""
        return [f"dev-{i}" for i in range(self.workers)]

    def env(self) -> dict[str, str]:
        """The environment every service of the stack gets."""
        return service_env(
            self.redis_url, self.cluster, self.coordinator, self.heartbeat_s, self.threads
        )

    def start(self) -> LocalStack:
        """Start everything (Redis first, workers last); returns self."""
        try:
            if self._url is None:
                self._redis = EmbeddedRedis().__enter__()
                self._url = self._redis.url
            coordinator = [*service_command("coordinator"), "--bind", self.coordinator]
            self._spawn("coordinator", coordinator)
            self._spawn("planner", service_command("planner"))
            self._spawn(
                "profiler",
                [*service_command("profiler"), "--serve", "--threads", str(self.threads)],
            )
            for name in self.devices:
                cmd = [*service_command("worker"), "--device", name]
                cmd += ["--threads", str(self.threads)]
                if self.memory_budget:
                    cmd += ["--memory-budget", str(self.memory_budget)]
                self._spawn(name, cmd)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        self.procs[name] = spawn(cmd, self.env(), self.log_dir / f"{name}.log")

    def check(self) -> None:
        """Raise ServiceDied if any service exited."""
        for name, p in self.procs.items():
            check_alive(name, p, self.log_dir / f"{name}.log")

    def tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a service's log."""
        return log_tail(self.log_dir / f"{name}.log", lines)

    def pids(self) -> list[int]:
        """Process ids of every child, Redis included."""
        out = [p.pid for p in self.procs.values()]
        if self._redis is not None and self._redis.proc is not None:
            out.append(self._redis.proc.pid)
        return out

    def stop(self, timeout_s: float = 8.0) -> None:
        """Stop workers and services, then Redis (idempotent)."""
        stop_all(list(self.procs.values()), timeout_s)
        if self._redis is not None:
            self._redis.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
