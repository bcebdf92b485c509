"""The testbed's faults beyond a device's: its link going down, the coordinator and Redis dying.

`ChaosTestbed` is a `Testbed` whose every part can fail and come back, as a
chaos run needs:

- a device's link goes down and comes back (`link_down`/`link_up`: its veth end
  inside its namespace, as a cable pulled and plugged in again; unlike `cut`,
  which drops packets on a link that stays up, the kernel sees no carrier and
  the device's connected route goes until the link is up again);
- a device's worker hangs and comes back (`sigstop`/`sigcont`: SIGSTOP and
  SIGCONT to the worker alone, its sockets open, its profiler running);
- the coordinator is SIGKILLed and started again with `--resume`
  (`kill_coordinator`/`restart_coordinator`), at the same address, so the
  workers, which keep trying to reach it, find the new one;
- Redis is SIGKILLed and started again on the same port from its append-only
  file (`kill_redis`/`start_redis`; the testbed is built with a `redis_dir`);
- a device switched on mid-job (`join`: one of the spec's `spare` devices,
  started beforehand with its link down by `stage`, so that joining is the
  link coming up) and a device powered on again after a kill (`power_on`).

Every process is still the testbed's: `down` stops what runs and removes the
namespaces, links and cgroups, also after a failed run. Processes started here
die with the thread that starts them (PR_SET_PDEATHSIG fires when the parent
*thread* exits), so call these from a thread that outlives the run (the main
one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any

from common.errors import AsteroidError, ConfigError
from services.testbed import net
from services.testbed.bed import Testbed

__all__ = ["ChaosTestbed"]

KILL_WAIT_S = 10.0
"""Longest wait for a SIGKILLed process to be reaped."""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group and reap it (bounded)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_WAIT_S)


class ChaosTestbed(Testbed):
    """A testbed whose links, coordinator and Redis can fail and come back."""

    __test__ = False
    _staged: set[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As `Testbed`."""
        super().__init__(*args, **kwargs)
        self._staged = set()

    # --- a device's link ----------------------------------------------------------

    def link_down(self, dev: str) -> None:
        """Take device `dev`'s link down (its end in its namespace): no carrier, no route."""
        net.run_all(net.link_state_commands(self.netns(dev), up=False))

    def link_up(self, dev: str) -> None:
        """Bring device `dev`'s link up again; its address's route comes back with it."""
        net.run_all(net.link_state_commands(self.netns(dev), up=True))

    def link_is_up(self, dev: str) -> bool:
        """Whether device `dev`'s end of its link is administratively up."""
        return net.link_is_up(self.netns(dev))

    # --- a device's worker --------------------------------------------------------

    def _worker(self, dev: str) -> subprocess.Popen[bytes]:
        proc = self.procs.get(f"{self.spec.device(dev).name}.worker")
        if proc is None or proc.poll() is not None:
            raise AsteroidError(f"device {dev} has no running worker")
        return proc

    def sigstop(self, dev: str) -> None:
        """SIGSTOP device `dev`'s worker: it hangs, its sockets stay open."""
        os.killpg(self._worker(dev).pid, signal.SIGSTOP)

    def sigcont(self, dev: str) -> None:
        """SIGCONT device `dev`'s worker: the hang ends."""
        os.killpg(self._worker(dev).pid, signal.SIGCONT)

    def power_on(self, dev: str) -> None:
        """Start a killed device's worker and profiler again."""
        self.start_device(dev)

    def stage(self, dev: str) -> None:
        """Start a spare device's worker with its link down: powered on, not yet connected.

        The worker imports torch and keeps trying to reach the coordinator; `join`
        then only brings the link up, so a join costs what joining costs, not
        a process start under the device's quota.
        """
        name = self._spare(dev)
        if name in self._staged:
            return
        self.link_down(name)
        # with no route to the coordinator the worker cannot find its own address: given
        self.start_worker(name, ["--advertise-host", self.address(name)])
        self._staged.add(name)

    def staged(self) -> set[str]:
        """Spare devices started by `stage` and not joined yet."""
        return set(self._staged)

    def join(self, dev: str) -> None:
        """Connect a spare device: a staged one's link comes up, else its services start."""
        name = self._spare(dev)
        self.spare.discard(name)
        staged = name in self._staged
        self._staged.discard(name)
        if staged:
            self.link_up(name)
        worker = self.procs.get(f"{name}.worker")
        if not staged or worker is None or worker.poll() is not None:  # not started, or died
            self.start_device(name)

    def _spare(self, dev: str) -> str:
        name = self.spec.device(dev).name
        if name not in self.spare:
            raise ConfigError(f"device {dev} is not a spare device of this testbed")
        return name

    def joined_workers(self) -> set[str]:
        """Devices whose worker the coordinator (any of its runs) logged as joined."""
        return self._joined()[0]

    # --- the coordinator ----------------------------------------------------------

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (the workers keep their stage state and retry)."""
        proc = self.procs.get("coordinator")
        self._gone.add("coordinator")
        if proc is not None:
            _kill(proc)

    def restart_coordinator(self, resume: bool = True) -> subprocess.Popen[bytes]:
        """Start the coordinator again at the same address; with `resume`, `--resume`."""
        proc = self.procs.get("coordinator")
        if proc is not None and proc.poll() is None:
            raise AsteroidError("the coordinator is still running: kill it first")
        return self.start_coordinator(["--resume"] if resume else [])

    # --- Redis ----------------------------------------------------------------------

    def kill_redis(self) -> None:
        """SIGKILL Redis: what it had not yet written to its append-only file is lost."""
        if self._redis is None or self._redis.proc is None:
            raise AsteroidError("the testbed's Redis is not running")
        self._redis.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._redis.proc.wait(timeout=KILL_WAIT_S)

    def start_redis(self) -> None:
        """Start Redis again on the same address and port, loading its append-only file.

        Returns once it answers (loading the file first); StoreError if it does not.
        """
        if self.redis_dir is None:
            raise ConfigError("the testbed's Redis keeps no append-only file (no redis_dir)")
        if self._redis is None:
            raise AsteroidError("the testbed's services are not running")
        if self._redis.proc is not None and self._redis.proc.poll() is None:
            raise AsteroidError("the testbed's Redis is still running: kill it first")
        self._redis = self._new_redis(self._redis.port).__enter__()

    def redis_pid(self) -> int | None:
        """The running Redis's process id (None while it is down)."""
        proc = self._redis.proc if self._redis is not None else None
        return proc.pid if proc is not None and proc.poll() is None else None
