"""What a chaos run needs from the place its cluster runs: the Backend protocol.

The runner and the schedule speak only to this protocol, so the same seeded
schedule runs on loopback (real processes on 127.0.0.1, in the default suite)
and on the namespace testbed (link cuts, one network namespace per device).
A backend says which event kinds it can inject (`supports`); the schedule draws
only those, so a run never asks a backend for what it cannot do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

Kind = Literal[
    "kill",  # SIGKILL one device
    "kill_stage",  # SIGKILL a stage's device and the device holding its replica (its backup)
    "second_kill",  # SIGKILL one device while the previous failure is still being recovered
    "stop_cont",  # SIGSTOP one device, SIGCONT it after the hold: a hang that comes back
    "cut_restore",  # cut one device's links, restore them after the hold
    "join",  # a new device registers while the job runs
    "drain",  # one device is drained (asteroid drain): it leaves at a round boundary
    "coordinator_restart",  # SIGKILL the coordinator, start it again with --resume
    "redis_restart",  # SIGKILL Redis, start it again from its append-only file
]
KINDS: tuple[Kind, ...] = get_args(Kind)
REMOVING: dict[Kind, int] = {
    "kill": 1,
    "kill_stage": 2,
    "second_kill": 1,
    # a hang or a cut longer than detection is a loss: counted as one, whatever happens
    "stop_cont": 1,
    "cut_restore": 1,
    "drain": 1,
}
"""How many devices an event may take from the job (the schedule's worst case)."""
CONTROL_PLANE: frozenset[Kind] = frozenset({"coordinator_restart", "redis_restart"})


class UnsupportedEvent(RuntimeError):
    """A backend was asked for an event kind it does not support."""


@runtime_checkable
class Backend(Protocol):
    """One cluster under chaos: start it, inject events, sample its processes, stop it.

    Devices are named by the strings the workers register with (`--device`).
    Every method returns once the action is done (a signal sent, a process
    started); none waits for the job to react: the runner does that, bounded.
    """

    name: str
    supports: frozenset[Kind]
    """The event kinds this backend can inject."""
    redis_url: str
    """Where the job's Redis answers (the same URL across a Redis restart)."""
    cluster: str
    """The Redis key prefix of the cluster (ASTEROID_CLUSTER)."""
    out: Path
    """A folder for logs and the run's outputs."""

    def start(self, devices: list[str], job: dict[str, Any], plan: dict[str, Any] | None) -> None:
        """Start Redis, the workers named `devices` and the coordinator for `job`.

        With `plan` None the job is planned by the planner (a profiler and a
        planner run too), which a join needs to take the new device in.
        """

    def close(self) -> list[str]:
        """Stop everything started; what had to be forced, as readable lines ([] if none)."""

    def coordinator_exit(self, timeout_s: float) -> int | None:
        """The coordinator's exit code once it ended within `timeout_s`, else None."""

    def kill(self, device: str) -> None:
        """SIGKILL the worker process of `device`."""

    def stop(self, device: str) -> None:
        """SIGSTOP the worker process of `device`."""

    def cont(self, device: str) -> None:
        """SIGCONT the worker process of `device`."""

    def cut_link(self, device: str) -> None:
        """Cut every network link of `device` (its processes keep running)."""

    def restore_link(self, device: str) -> None:
        """Bring back the links `cut_link` cut."""

    def join(self, new_device: str) -> None:
        """Start a worker for a device named `new_device` that was not there before."""

    def drain(self, device: str) -> None:
        """Ask the coordinator to drain `device` (the `asteroid drain` request)."""

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator."""

    def start_coordinator(self, resume: bool = True) -> None:
        """Start the coordinator again for the same job; with `resume`, picking it up from Redis."""

    def kill_redis(self) -> None:
        """SIGKILL the job's redis-server."""

    def start_redis(self) -> None:
        """Start the redis-server again on the same address from its append-only file."""

    def pids(self) -> dict[str, int]:
        """Every live process of the cluster (Redis, coordinator, workers...) by a stable name.

        The runner samples RSS and open fds of each; a name must mean the same
        process across samples (a restarted coordinator gets a new name).
        """

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of process `name`'s log, for failure messages."""


def require(backend: Backend, kind: Kind) -> None:
    """Raise UnsupportedEvent unless `backend` supports `kind`."""
    if kind not in backend.supports:
        raise UnsupportedEvent(f"the {backend.name} backend cannot inject {kind!r}")
