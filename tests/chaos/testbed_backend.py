"""The chaos Backend on the namespace testbed: every device a network namespace of its own.

Each device is a `services.testbed.chaos.ChaosTestbed` device: its own
network namespace and shaped veth link, a cgroup with a CPU quota and a
memory limit, its own host name; Redis (with its append-only file), the
coordinator and the planner run on the host side of the bridge. So every
event kind is real here, the link cut included: a cut takes the device's
veth end down inside its namespace (no carrier, no route) and a restore
brings it up, which loopback cannot do.

Devices that join are known before the run: the testbed is built with
`spares` spare devices named as the schedule names joiners (`j1`, `j2`, ...),
their namespaces and cgroups ready. The next `AHEAD` of them run their worker
with their link down (started, importing torch, unable to reach anyone); a
join brings the link up, so it costs what joining costs rather than a process
start under a fraction of a core. The coordinator runs the job itself
(`--job FILE`): profiled, planned by the planner (so a join can re-plan),
and, killed, started again with `--job FILE --resume`.

Subnet 10.92.0.0/24: no bench uses it (their SUBNET constants), so a chaos
run may share the machine with any of them. Root only.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from common.ids import DeviceId
from common.messages import DrainDevice
from services.cli.client import ask_coordinator
from services.testbed.chaos import ChaosTestbed
from services.testbed.spec import TestbedDevice, TestbedSpec
from services.testbed.survey import cleanup_leftovers, find
from tests.chaos.backend import KINDS, Kind

__all__ = ["SUBNET", "TestbedBackend", "spec_for"]

SUBNET = "10.92.0.0/24"
"""Not a subnet any bench uses, so a chaos run and a bench may run side by side."""
MiB = 1 << 20
DEVICE_CPU = 0.3
"""Cores per device: five live devices take 1.5 of a 2-core machine's cores."""
DEVICE_MEMORY = 768 * MiB
"""An idle worker is charged ~240 MiB, training small_cnn ~265 MiB (see services.testbed.spec)."""
LINK_BPS = 100e6
READY_S = 400.0
"""Importing torch under a 0.3-core quota on a loaded machine takes a while."""
DRAIN_REPLY_S = 30.0
AHEAD = 2
"""Spare devices kept started with their link down, ready to join (`ChaosTestbed.stage`)."""


def spec_for(devices: list[str], spares: int, subnet: str = SUBNET) -> TestbedSpec:
    """The chaos testbed: `devices`, then `spares` devices named `j1`, `j2`, ... for joins."""
    names = [*devices, *(f"j{i}" for i in range(1, spares + 1))]
    return TestbedSpec(
        name="chaos",
        subnet=subnet,
        devices=[
            TestbedDevice(
                name=n,
                kind="chaos device",
                cpu=DEVICE_CPU,
                memory_bytes=DEVICE_MEMORY,
                bandwidth_bps=LINK_BPS,
            )
            for n in names
        ],
    )


class TestbedBackend:
    """A chaos cluster on the namespace testbed (see the module's doc)."""

    __test__ = False
    name = "testbed"
    supports: frozenset[Kind] = frozenset(KINDS)

    def __init__(
        self, out: Path, spares: int = 16, subnet: str = SUBNET, heartbeat_s: float = 0.5
    ) -> None:
        self.out = out
        self.spares, self.subnet, self.heartbeat_s = spares, subnet, heartbeat_s
        self.redis_url = ""
        self.cluster = "chaos"
        self.bed: ChaosTestbed | None = None
        self._keys_env: str | None = None
        self._generation: dict[str, int] = {}

    def _bed(self) -> ChaosTestbed:
        if self.bed is None:
            raise RuntimeError("the testbed backend is not started")
        return self.bed

    # --- lifecycle ----------------------------------------------------------------

    def start(self, devices: list[str], job: dict[str, Any], plan: dict[str, Any] | None) -> None:
        """Build the testbed, start Redis, the coordinator for `job`, the planner and `devices`."""
        self.out.mkdir(parents=True, exist_ok=True)
        job_file = self.out / "job.yaml"
        job_file.write_text(yaml.safe_dump(job))
        spec = spec_for(devices, self.spares, self.subnet)
        spares = [d for d in spec.names() if d not in devices]
        redis_dir = self.out / "redis"
        if redis_dir.exists():  # a file left by an earlier run would be loaded
            for f in redis_dir.rglob("*"):
                if f.is_file():
                    f.unlink()
        bed = ChaosTestbed(
            spec,
            self.out / "logs",
            cluster=self.cluster,
            heartbeat_s=self.heartbeat_s,
            redis_dir=redis_dir,
            spare=spares,
        )
        # the devices start (import torch under their quota) while the coordinator waits
        bed.coordinator_args = ["--job", str(job_file), "--join-timeout-s", str(READY_S)]
        bed.coordinator_args.append("--shutdown-workers")  # the job's end ends every device's
        if plan is not None:
            plan_file = self.out / "plan.json"
            plan_file.write_text(json.dumps(plan))
            bed.coordinator_args += ["--plan", str(plan_file)]
        self.bed = bed
        # whatever the caller does on an error, the namespaces, links and cgroups go at exit
        atexit.register(self.close)
        bed.up(services=True, ready_timeout_s=READY_S)
        self.redis_url = bed.redis_url
        self._stage_ahead()
        # the runner is this testbed's operator: its requests (drain) use the testbed's keys
        self._keys_env = os.environ.get("ASTEROID_KEYS")
        os.environ["ASTEROID_KEYS"] = str(bed.keys)

    def close(self) -> list[str]:
        """Take the testbed down; what was left behind (and then removed), as lines."""
        if self.bed is None:
            return []
        tag = self.bed.tag
        atexit.unregister(self.close)
        self.bed.down()
        self.bed = None
        if self._keys_env is None:
            os.environ.pop("ASTEROID_KEYS", None)
        else:
            os.environ["ASTEROID_KEYS"] = self._keys_env
        left = find(tag).get(tag)
        if left is None:
            return []
        cleanup_leftovers(tag)
        return [f"testbed {tag} left {left} behind after down; removed"]

    def coordinator_exit(self, timeout_s: float) -> int | None:
        proc = self._bed().procs.get("coordinator")
        if proc is None:
            return None
        try:
            return proc.wait(timeout=timeout_s)
        except Exception:  # subprocess.TimeoutExpired: still running
            return None

    # --- events -------------------------------------------------------------------

    def kill(self, device: str) -> None:
        """Power `device` off: every process in it SIGKILLed (worker and profiler)."""
        self._bed().kill(device)

    def stop(self, device: str) -> None:
        self._bed().sigstop(device)

    def cont(self, device: str) -> None:
        self._bed().sigcont(device)

    def cut_link(self, device: str) -> None:
        self._bed().link_down(device)

    def restore_link(self, device: str) -> None:
        self._bed().link_up(device)

    def _stage_ahead(self) -> None:
        """Keep `AHEAD` spare devices started with their link down, the next joiners first."""
        bed = self._bed()
        waiting = [d for d in bed.devices if d in bed.spare]
        for dev in waiting[:AHEAD]:
            bed.stage(dev)

    def join(self, new_device: str) -> None:
        """Connect the spare device `new_device` and wait until its worker joined.

        A staged device (the usual case) only has its link brought up; one not
        staged yet starts its worker, importing torch under its quota. Either
        way the wait (bounded by `READY_S`) is the device coming on, not the
        job's reaction to it. ConfigError if the testbed has no such spare.
        """
        bed = self._bed()
        bed.join(new_device)
        self._stage_ahead()
        deadline = time.monotonic() + READY_S
        worker = bed.procs[f"{new_device}.worker"]
        while new_device not in bed.joined_workers():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{new_device}'s worker did not join within {READY_S:.0f} s (exit code "
                    f"{worker.poll()}):\n{bed.tail(f'{new_device}.worker')}"
                )
            time.sleep(0.2)

    def drain(self, device: str) -> None:
        reply = ask_coordinator(
            self._bed().coordinator, DrainDevice(target=DeviceId(device)), DRAIN_REPLY_S
        )
        if not reply.ok:
            raise RuntimeError(f"drain of {device} refused: {reply.error}")

    def kill_coordinator(self) -> None:
        self._bed().kill_coordinator()

    def start_coordinator(self, resume: bool = True) -> None:
        self._bed().restart_coordinator(resume=resume)

    def kill_redis(self) -> None:
        self._bed().kill_redis()

    def start_redis(self) -> None:
        self._bed().start_redis()

    # --- sampling -----------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """Live processes as "name@pid": a restarted process is a new name.

        Safe from a sampling thread: it copies the process table before reading it.
        """
        bed = self._bed()
        out = {
            f"{name}@{proc.pid}": proc.pid
            for name, proc in list(bed.procs.items())
            if proc.poll() is None
        }
        redis_pid = bed.redis_pid()
        if redis_pid is not None:
            out[f"redis@{redis_pid}"] = redis_pid
        return out

    def log_tail(self, name: str, lines: int = 30) -> str:
        if self.bed is None:
            return "(the testbed is down)"
        base = name.partition("@")[0]
        with contextlib.suppress(OSError):
            return self.bed.tail(base, lines)
        return "(no log)"
