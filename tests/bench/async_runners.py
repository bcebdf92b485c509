"""Where bench_async's jobs run: emulated devices (root) or loopback (the smoke test).

Each run is a coordinator of its own on the host side and fresh workers (inside
the devices on the testbed), on a cluster name of its own in Redis. A run may
be given `Extras`: the cluster and profile its hand-made plan was made for,
written where a coordinator reads the cluster its job was planned for, so that
measured speeds can move the partition points (the dynamic partition needs
layer costs); and a throttle, a device's CPU quota cut once a round commits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.profile import ClusterSpec, Profile

PRESET = "env-d"
SUBNET = "10.89.0.0/24"
"""No other testbed bench's subnet."""
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Throttle:
    """Cut `device`'s CPU quota to `cpu` cores once `at` rounds are committed."""

    at: int
    device: str
    cpu: float


@dataclass(frozen=True)
class Extras:
    """What a run of part 2 adds: the plan's cluster and profile, and a throttle."""

    cluster: ClusterSpec
    profile: Profile
    throttle: Throttle | None = None


@dataclass
class Outcome:
    """What a runner saw besides the streams: when it throttled."""

    cut_round: int | None = None


def _worker_env(
    redis_url: str, cluster: str, coordinator: str, keys: Path | None
) -> dict[str, str]:
    env = {
        "ASTEROID_REDIS_URL": redis_url,
        "ASTEROID_CLUSTER": cluster,
        "ASTEROID_COORDINATOR": coordinator,
        "ASTEROID_HEARTBEAT_S": "0.5",
        "ASTEROID_LOG_FORMAT": "json",
        "ASTEROID_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    if keys is not None:
        env["ASTEROID_KEYS"] = str(keys)
    return env


def read_streams(
    redis_url: str, cluster: str, job_id: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The job's metrics and events."""
    from common.store import Store

    store = Store(redis_url, cluster)
    try:
        return list(store.read("metrics", job_id)), list(store.read("events", job_id))
    finally:
        store.close()


def seed(redis_url: str, cluster: str, job_id: str, extras: Extras | None) -> None:
    """Write the cluster and profile the job's plan was made for (none: nothing)."""
    if extras is None:
        return
    from common.records.documents import put_cluster
    from common.store import Store
    from services.profiler.cache import save

    store = Store(redis_url, cluster)
    try:
        save(store, extras.profile)
        put_cluster(store, job_id, extras.cluster)
    finally:
        store.close()


def _write_inputs(logs: Path, job: dict[str, Any], plan: dict[str, Any]) -> tuple[Path, Path]:
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "job.yaml").write_text(yaml.safe_dump(job))
    (logs / "plan.json").write_text(json.dumps(plan))
    return logs / "job.yaml", logs / "plan.json"


class TestbedRunner:
    """Runs jobs on an up testbed (no services): fresh workers and a coordinator per run."""

    __test__ = False

    def __init__(self, bed: Any, redis_url: str, keys: Path, logs: Path) -> None:
        self.bed, self.redis_url, self.keys, self.logs = bed, redis_url, keys, logs
        self.count = 0
        self.extras: Extras | None = None
        self.outcome = Outcome()

    def __call__(
        self, label: str, job: dict[str, Any], plan: dict[str, Any]
    ) -> tuple[int | None, list[dict[str, Any]], list[dict[str, Any]]]:
        from common.procs import spawn, stop_all
        from services.testbed.bed import _free_port

        self.count += 1
        self.outcome = Outcome()
        logs = self.logs / label
        job_file, plan_file = _write_inputs(logs, job, plan)
        coordinator = f"tcp://{self.bed.bridge}:{_free_port(self.bed.bridge)}"
        cluster = f"abench-{os.getpid()}-{self.count}"
        seed(self.redis_url, cluster, str(job["job_id"]), self.extras)
        env = _worker_env(self.redis_url, cluster, coordinator, self.keys)
        pairs = [f"{k}={v}" for k, v in env.items()]
        procs = []
        throttle = self.extras.throttle if self.extras is not None else None
        cpu0 = {d.name: d.cpu for d in self.bed.spec.devices}
        try:
            for stage in plan["stages"]:
                dev = stage["devices"][0]["device"]
                worker = [sys.executable, "-m", "services.worker.main", "--device", dev]
                procs.append(self.bed.start(dev, f"{label}/{dev}.worker", ["env", *pairs, *worker]))
            cmd = [sys.executable, "-m", "services.coordinator.main", "--bind", coordinator]
            cmd += ["--shutdown-workers", "--job", str(job_file), "--plan", str(plan_file)]
            coord = spawn(cmd, {**os.environ, **env}, logs / "coordinator.log")
            procs.append(coord)
            code = self._wait(coord, cluster, str(job["job_id"]), throttle)
            return (code, *read_streams(self.redis_url, cluster, str(job["job_id"])))
        finally:
            stop_all(procs, timeout_s=10.0)
            if throttle is not None:
                self.bed.slow(throttle.device, cpu0[throttle.device])

    def _wait(self, coord: Any, cluster: str, job_id: str, throttle: Throttle | None) -> int | None:
        """The coordinator's exit code; on the way, throttle once `throttle.at` rounds commit."""
        if throttle is None:
            code: int | None = coord.wait(timeout=RUN_TIMEOUT_S)
            return code
        from common.store import Store

        store = Store(self.redis_url, cluster)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if coord.poll() is not None:
                    return int(coord.returncode)
                if self.outcome.cut_round is None:
                    committed = int(store.get_fields("job", job_id).get("round", 0) or 0)
                    if committed >= throttle.at:
                        self.bed.slow(throttle.device, throttle.cpu)
                        self.outcome.cut_round = committed
                time.sleep(0.05)
        finally:
            store.close()
        coord.kill()
        return None


class LocalRunner:
    """Runs jobs on loopback (no emulation, no root, no throttle): the smoke test's runner."""

    def __init__(self, redis_url: str, logs: Path, timeout_s: float = 120.0) -> None:
        self.redis_url, self.logs, self.timeout_s = redis_url, logs, timeout_s
        self.clusters: list[str] = []
        self.extras: Extras | None = None
        self.outcome = Outcome()

    def __call__(
        self, label: str, job: dict[str, Any], plan: dict[str, Any]
    ) -> tuple[int | None, list[dict[str, Any]], list[dict[str, Any]]]:
        from tests.cluster import LocalCluster

        logs = self.logs / label
        logs.mkdir(parents=True, exist_ok=True)
        cluster_name = f"abench-{os.getpid()}-{len(self.clusters)}"
        self.clusters.append(cluster_name)
        seed(self.redis_url, cluster_name, str(job["job_id"]), self.extras)
        cluster = LocalCluster(logs, self.redis_url, cluster_name)
        try:
            cluster.start_workers([s["devices"][0]["device"] for s in plan["stages"]])
            cluster.start_coordinator(job, plan)
            code = cluster.wait("coordinator", self.timeout_s)
            return (code, *read_streams(self.redis_url, cluster_name, str(job["job_id"])))
        finally:
            cluster.close()

    def forget(self) -> None:
        """Delete every key the runs left in Redis."""
        import redis

        r = redis.Redis.from_url(self.redis_url)
        try:
            for name in self.clusters:
                keys = list(r.scan_iter(match=f"asteroid:{name}:*", count=1000))
                if keys:
                    r.delete(*keys)
        finally:
            r.close()


@contextmanager
def testbed_runner(out: Path) -> Iterator[tuple[TestbedRunner, Any]]:
    """The env-d testbed (own subnet) with a Redis on its bridge; removed on exit."""
    from common.curve import create_key_set
    from common.embedded_redis import EmbeddedRedis
    from services.testbed.bed import Testbed
    from services.testbed.spec import preset

    spec = preset(PRESET, "1gbit").model_copy(update={"name": "async-bench", "subnet": SUBNET})
    logs = out / "logs"
    with Testbed(spec, logs / "testbed") as bed:
        bed.up(services=False)
        keys = logs / "keys"
        create_key_set(keys, bed.devices)
        with EmbeddedRedis(host=bed.bridge) as redis:
            yield TestbedRunner(bed, redis.url, keys, logs), spec
