"""Heartbeat jitter as the coordinator sees it: what the derived timeouts' k and floors rest on.

    python -m tests.bench.bench_heartbeat_jitter [--rounds N] [--heartbeat-s S] [--burn P]
                                                 [--out DIR] [--deadline-s S]

A small_cnn job (fixed plan, four local workers a-d, a real coordinator) trains
`--rounds` rounds while the coordinator records the arrival time of every
heartbeat, at the point where its liveness bookkeeping takes it (a tap on its
dispatch, nothing else changed). `--burn P` adds P processes spinning on the
CPU for the whole run, a machine busier than the workers alone make it. The
table gives, per device and over all, the inter-arrival gaps' median, p90, p99
and maximum (and of the rounds' times, from the job's metrics, round 0 left
out), and the timeouts `services.coordinator.timeouts.derive` gives for
them under the default settings; printed and, with `--out`, written as
heartbeat_jitter.md.

Redis: the one at ASTEROID_REDIS_URL (default 127.0.0.1:6379) if it answers,
else an embedded one. Every child is stopped when the run ends.

Exit code 0 when the job finished, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from common.embedded_redis import EmbeddedRedis
from common.ids import DeviceId
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator.timeouts import (
    Bounds,
    Observed,
    derive,
    observe_beat,
    observe_round,
    quantile,
)
from tests.cluster import Budget, LocalCluster
from tests.integration.test_equivalence import stage

WORKERS = ["a", "b", "c", "d"]
PLAN = {
    "global_batch": 32,
    "microbatches": 4,
    "stages": [stage(0, 2, "a"), stage(2, 4, "b"), stage(4, 7, "c", "d")],
}
TAP = """
import sys, time
from common.messages import Heartbeat
from services.coordinator import service
out = open(sys.argv[1], "a", buffering=1)
dispatch = service.Coordinator._dispatch
def tapped(self, peer, msg):
    if isinstance(msg, Heartbeat):
        out.write(f"{msg.device} {time.monotonic():.6f}\\n")
    return dispatch(self, peer, msg)
service.Coordinator._dispatch = tapped
from services.coordinator.main import main
main(sys.argv[2:])
"""
"""The coordinator, with every heartbeat's arrival written to a file before it is handled."""


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """`count` processes spinning on a CPU each until the block ends."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join(5)


@contextlib.contextmanager
def _redis_url() -> Iterator[str]:
    url = os.environ.get("ASTEROID_REDIS_URL", "redis://127.0.0.1:6379/0")
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        yield url
    except redis.RedisError:
        with EmbeddedRedis() as server:
            yield server.url


def run(
    rounds: int, heartbeat_s: float, burn: int, deadline_s: float
) -> tuple[dict[str, list[float]], list[float]]:
    """Arrival times of each worker's heartbeats while the job ran, and its rounds' seconds."""
    budget = Budget(deadline_s)
    with tempfile.TemporaryDirectory() as tmp, burners(burn), _redis_url() as url:
        name = f"jitter-{uuid.uuid4().hex[:8]}"
        cluster = LocalCluster(Path(tmp), url, name, heartbeat_s, budget)
        try:
            cluster.start_workers(WORKERS)
            job = {
                "job_id": "jitter",
                "model": {"name": "small_cnn"},
                "seed": 3,
                "rounds": rounds,
                "optimizer": {"kind": "sgd", "lr": 0.01},
                "dataset": {"kind": "synthetic", "train_size": 32 * rounds},
            }
            beats = Path(tmp) / "beats.txt"
            args = ["--bind", cluster.addr, "--shutdown-workers"]
            args += ["--job", str(cluster.write("job.yaml", job))]
            args += ["--plan", str(cluster.write("plan.json", PLAN))]
            cluster.spawn("coordinator", ["-c", TAP, str(beats), *args])
            code = cluster.wait("coordinator", deadline_s)
            if code != 0:
                raise SystemExit(f"the job failed ({code}):\n{cluster.log_tail('coordinator')}")
            times: dict[str, list[float]] = {}
            for line in beats.read_text().splitlines():
                dev, at = line.split()
                times.setdefault(dev, []).append(float(at))
            store = Store(url, name)
            try:
                metrics = store.read("metrics", "jitter")
                store.delete(*store.keys(""))
            finally:
                store.close()
            return times, [float(m["round_s"]) for m in metrics if "round_s" in m]
        finally:
            cluster.close()


def report(
    times: dict[str, list[float]], round_s: list[float], heartbeat_s: float, burn: int
) -> str:
    """The gaps' table and the timeouts derived from them, as markdown."""
    settings = CoordinatorSettings(heartbeat_s=heartbeat_s)
    obs, rows, every = Observed(), [], []
    for r in round_s[1:]:  # round 0 pays for connections and first allocations
        obs = observe_round(obs, r)
    for dev in sorted(times):
        ts = sorted(times[dev])
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        every += gaps
        for t in ts:
            obs = observe_beat(obs, DeviceId(dev), t)
        rows.append((dev, gaps))
    rows.append(("all", every))
    load = os.getloadavg()
    lines = [
        f"heartbeat_s {heartbeat_s:g}, {len(round_s)} rounds of small_cnn on 4 workers, "
        f"{burn} extra CPU burners, {os.cpu_count()} cores, "
        f"load average {load[0]:.1f} {load[1]:.1f}",
        "",
        "| device | gaps | median ms | p90 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    for dev, gaps in rows:
        if not gaps:
            continue
        q = [quantile(gaps, p) * 1000 for p in (0.5, 0.9, 0.99, 1.0)]
        lines.append(f"| {dev} | {len(gaps)} | " + " | ".join(f"{v:.0f}" for v in q) + " |")
    if len(round_s) > 1:
        q = [quantile(round_s[1:], p) * 1000 for p in (0.5, 0.9, 0.99, 1.0)]
        lines.append(f"| rounds | {len(round_s) - 1} | " + " | ".join(f"{v:.0f}" for v in q) + " |")
    eff = derive(Bounds.of(settings), obs)
    lines += ["", "derived from the last window of each device (default settings as bounds):"]
    for name in ("heartbeat_deadline_s", "probe_timeout_s", "flap_grace_s", "peer_timeout_s"):
        lines.append(f"- {name}: {getattr(eff, name):.3f} s, {eff.why[name]}")
    return "\n".join(lines)


def main() -> None:
    """Run the job, print the table (and write it with --out)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--burn", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--deadline-s", type=float, default=600.0)
    a = ap.parse_args()
    began = time.monotonic()
    times, round_s = run(a.rounds, a.heartbeat_s, a.burn, a.deadline_s)
    text = report(times, round_s, a.heartbeat_s, a.burn)
    text += f"\n\n(run took {time.monotonic() - began:.0f} s)"
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "heartbeat_jitter.md").write_text(text + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
