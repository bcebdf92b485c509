"""The real-homes FL bench's effectful part: the homes' and the federation's processes.

A run starts every home's workers (inside their devices, at `STARTUP_CPU` so torch's
import does not take a minute) and coordinators, waits until each home's workers
joined its coordinator, sets each device's own CPU quota, and only then starts the
federation: the homes' first rounds run at their real speeds, and the federation's
clock does not count the homes' start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tests.bench.fl_homes_report import (
    curve_of,
    regroup_events,
    round_latencies,
    since_warmup,
    warmup_end,
)
from tests.bench.fl_homes_setup import (
    FED_DEVICE,
    FED_PORT,
    HOMES,
    SLOW_CPU,
    SLOW_HOME,
    START_ALLOWANCE_S,
    RunResult,
    RunSpec,
    federation_spec,
    home_job,
    home_plan,
)


def joined_workers(log: Path) -> set[str]:
    """Workers a coordinator's JSON log says joined it."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    out: set[str] = set()
    for line in lines:
        with contextlib.suppress(ValueError, AttributeError):
            event = json.loads(line)
            if event.get("event") == "worker joined":
                out.add(str(event.get("worker")))
    return out


class Bench:
    """The testbed and its Redis, kept across runs; each run's processes are its own."""

    def __init__(self, bed: Any, redis_url: str, out: Path, args: argparse.Namespace) -> None:
        self.bed, self.redis_url, self.out, self.args = bed, redis_url, out, args
        self.home_keys = out / "keys-homes"
        self.fed_keys = out / "keys-federation"
        self.procs: list[subprocess.Popen[bytes]] = []

    def make_keys(self) -> None:
        """One key set for the homes' clusters, one for the federation (a pair per home)."""
        from common.curve import create_key_set

        for d in (self.home_keys, self.fed_keys):
            shutil.rmtree(d, ignore_errors=True)
        create_key_set(self.home_keys, [n for h in HOMES for n, _, _ in h.devices])
        create_key_set(self.fed_keys, [f"home-{h}" for h in range(len(HOMES))])

    def env(self, cluster: str, coordinator: str) -> dict[str, str]:
        """What a home's services are told: its Redis prefix, coordinator and keys.

        Heartbeats every 2 s: a 0.06-core device's worker, busy with its model, does
        not get a 0.5 s heartbeat out in time, and would be declared dead.
        """
        return {
            "ASTEROID_REDIS_URL": self.redis_url,
            "ASTEROID_CLUSTER": cluster,
            "ASTEROID_COORDINATOR": coordinator,
            "ASTEROID_KEYS": str(self.home_keys),
            "ASTEROID_HEARTBEAT_S": "2.0",
            "ASTEROID_LOG_FORMAT": "json",
            "ASTEROID_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }

    def in_device(self, dev: str, name: str, env: dict[str, str], cmd: list[str]) -> None:
        """Start `cmd` inside device `dev` with `env` on top of this process's environment."""
        pairs = [f"{k}={v}" for k, v in env.items()]
        self.procs.append(self.bed.start(dev, name, ["env", *pairs, *cmd]))

    def set_quotas(self, startup: float | None = None) -> None:
        """Each home device at its own quota (or all at `startup`)."""
        for home in HOMES:
            for n, _, c in home.devices:
                self.bed.slow(n, c if startup is None else startup)

    def run(self, spec: RunSpec, index: int, stop: threading.Event, startup: float) -> RunResult:
        """Start the homes, then the federation; follow the curve; stop all of it."""
        logs = self.out / "logs" / spec.label
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        result = RunResult(spec.strategy, spec.alpha, spec.slowdown)
        fid, prefix = "digits", f"flh{os.getpid()}-{index}"
        fed_addr = f"tcp://{self.bed.address(FED_DEVICE[0])}:{FED_PORT + index}"
        t0 = time.monotonic()
        try:
            self.set_quotas(startup)
            for h in range(len(HOMES)):
                self._start_home(spec, h, fid, prefix, fed_addr, logs)
            if not self._homes_ready(logs, stop):
                result.state, result.note = "timeout", "home workers did not join in time"
                return result
            self.set_quotas()
            fed = self._start_federation(spec, fid, prefix, fed_addr, logs)
            self._follow(spec, result, fed, f"{prefix}-fed", fid, stop)
        finally:
            from common.procs import stop_all

            stop_all(self.procs, timeout_s=10.0)
            self.procs.clear()
            result.wall_s = time.monotonic() - t0
            self._read_curve(result, f"{prefix}-fed", fid)
        return result

    def _homes_ready(self, logs: Path, stop: threading.Event) -> bool:
        deadline = time.monotonic() + START_ALLOWANCE_S
        while not stop.is_set() and time.monotonic() < deadline:
            if all(
                {n for n, _, _ in home.devices} <= joined_workers(logs / f"coordinator-h{h}.log")
                for h, home in enumerate(HOMES)
            ):
                return True
            time.sleep(0.5)
        return False

    def _start_federation(
        self, spec: RunSpec, fid: str, prefix: str, address: str, logs: Path
    ) -> subprocess.Popen[bytes]:
        path = logs / "federation.yaml"
        path.write_text(yaml.safe_dump(federation_spec(spec.strategy, fid, self.args.updates)))
        cmd = [sys.executable, "-m", "services.federation.main", "--bind", address]
        cmd += ["--spec", str(path), "--keys", str(self.fed_keys), "--exit-when-done"]
        env = {
            "ASTEROID_REDIS_URL": self.redis_url,
            "ASTEROID_CLUSTER": f"{prefix}-fed",
            "ASTEROID_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
            "ASTEROID_DONE_GRACE_S": "10",
        }
        self.in_device(FED_DEVICE[0], f"{spec.label}/federation", env, cmd)
        return self.procs[-1]

    def _start_home(
        self, spec: RunSpec, h: int, fid: str, prefix: str, fed_addr: str, logs: Path
    ) -> None:
        from common.procs import spawn
        from services.testbed.bed import _free_port

        bridge = self.bed.bridge
        coordinator = f"tcp://{bridge}:{_free_port(bridge)}"
        env = self.env(f"{prefix}-h{h}", coordinator)
        for n, _, _ in HOMES[h].devices:
            worker = [sys.executable, "-m", "services.worker.main", "--device", n]
            self.in_device(n, f"{spec.label}/{n}", env, worker)
        job = home_job(h, spec.alpha, fid, fed_addr, str(self.fed_keys))
        (logs / f"job-h{h}.yaml").write_text(yaml.safe_dump(job))
        (logs / f"plan-h{h}.json").write_text(json.dumps(home_plan(h)))
        cmd = [sys.executable, "-m", "services.coordinator.main", "--bind", coordinator]
        cmd += ["--shutdown-workers", "--job", str(logs / f"job-h{h}.yaml")]
        cmd += ["--plan", str(logs / f"plan-h{h}.json")]
        self.procs.append(spawn(cmd, {**os.environ, **env}, logs / f"coordinator-h{h}.log"))

    def _follow(
        self,
        spec: RunSpec,
        result: RunResult,
        federation: subprocess.Popen[bytes],
        cluster: str,
        fid: str,
        stop: threading.Event,
    ) -> None:
        """Until the federation exits, the budget is spent or the bench is stopped.

        The budget and the throttle count from the warm-up round's end.
        """
        from common.store import Store

        budget, started = float(self.args.budget), time.monotonic()
        zero: float | None = None  # monotonic time of the warm-up round's end
        store = Store(self.redis_url, cluster)
        try:
            while not stop.is_set():
                entries = store.read("fl-metrics", fid)
                warm = warmup_end(entries)
                if zero is None and warm is not None:
                    zero = time.monotonic() - (float(entries[-1]["time_s"]) - warm)
                now = 0.0 if zero is None else time.monotonic() - zero
                if spec.slowdown and result.slowed_at_s is None and now >= budget / 2:
                    for n, _, _ in HOMES[SLOW_HOME].devices:
                        self.bed.slow(n, SLOW_CPU)
                    result.slowed_at_s = now
                if federation.poll() is not None:
                    result.state = "done" if federation.returncode == 0 else "failed"
                    if federation.returncode != 0:
                        result.note = f"federation exited {federation.returncode}"
                    return
                if now >= budget:
                    result.state = "budget"
                    return
                if time.monotonic() - started > budget + START_ALLOWANCE_S:
                    result.state = "timeout"
                    result.note = f"no federation clock within {START_ALLOWANCE_S:.0f} s"
                    return
                time.sleep(0.5)
            result.state = "stopped"
        finally:
            store.close()

    def _read_curve(self, result: RunResult, cluster: str, fid: str) -> None:
        from common.store import Store

        store = Store(self.redis_url, cluster)
        try:
            entries = store.read("fl-metrics", fid)
        finally:
            store.close()
        result.warmup_s = warmup_end(entries)
        entries = since_warmup(entries)
        result.times, result.accuracies, result.versions = curve_of(entries)
        result.regroups = regroup_events(entries)
        result.latencies = round_latencies(entries)
        failed = sorted({h for e in entries for h in e.get("failed") or []})
        if failed:
            result.note += f" homes failing a round: {failed}"
