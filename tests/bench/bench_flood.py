"""Heartbeat-flood benchmark: round time under a flood from one id over the undisturbed one.

    python -m tests.bench.bench_flood [--out DIR] [--rounds N] [--repeats R] [--rate HZ]
                                      [--flood-s S] [--deadline-s S]

The same small_cnn job (fixed plan, three local workers, a real coordinator) runs
undisturbed and under a flood, alternately, `--repeats` times each. The flood starts
once the job's first round is committed and lasts `--flood-s` seconds: a DEALER
sends `--rate` heartbeats a second from one made-up id to the coordinator. The
flooded job has enough rounds to outlast the flood; only rounds that ran entirely
inside the flood window count (their commit time is the Redis stream entry's id).
Round 0 of every run (connections, first allocations) counts in neither case.
The table gives the median round time of each case and their ratio (the issue's
aim: below 1.5), printed and, with `--out`, written as flood.md and flood.csv.

Redis: the one at ASTEROID_REDIS_URL (default 127.0.0.1:6379) if it answers, else
an embedded one for this run. Every child is stopped when its run ends, SIGTERM
to this process included, and all runs together stay within `--deadline-s`.

Exit code 0 when the run completed (aim met or not), 1 when it failed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

import redis
import zmq

from common.codec import encode
from common.embedded_redis import EmbeddedRedis
from common.errors import StoreError
from common.messages import Heartbeat
from common.store import Store
from tests.cluster import Budget, LocalCluster
from tests.integration.test_equivalence import SGD, stage

STAGES = [stage(0, 3, "a"), stage(3, 7, "b", "c")]
JOB_ID = "bench"
BURST = 500
"""Heartbeats sent back to back before the flooder checks its pace and its stop."""
TARGET = 1.5
"""Aim for the flooded over the undisturbed median round time."""
POLL_S = 0.02
"""How often the parent looks for the first committed round."""
STOP_FLOOD_S = 10.0
"""Longest wait for the flooder thread to finish its last burst."""


@dataclass
class Run:
    """What one job run measured."""

    flooded: bool
    rounds: list[float] = field(default_factory=list)  # round seconds that count
    sent: int = 0  # heartbeats sent
    flood_s: float = 0.0  # how long the flood actually lasted


def flood(address: str, rate: float, stop: threading.Event, sent: list[int]) -> None:
    """Send `rate` heartbeats a second from id "flood" until `stop`, counting in `sent[0]`."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"flood")
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    frames = encode(Heartbeat(device="flood", data_addr="tcp://127.0.0.1:9"), "flood")
    start = time.monotonic()
    try:
        while not stop.is_set():
            for _ in range(BURST):
                sock.send_multipart(frames)
            sent[0] += BURST
            stop.wait(max(0.0, start + sent[0] / rate - time.monotonic()))
    finally:
        sock.close(0)
        ctx.term()


def _commits(client: redis.Redis, key: str) -> list[tuple[float, float]]:
    """(commit time, round seconds) of each committed round, oldest first.

    The commit time is the metrics entry's id, the Redis server's clock in
    milliseconds when the coordinator appended it (the same machine's clock).
    """
    out = []
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(key))
    for entry_id, fields in entries:
        if b"round_s" in fields:
            ms = int(entry_id.decode().split("-", 1)[0])
            out.append((ms / 1e3, float(fields[b"round_s"])))
    return out


def _wait_first_round(
    client: redis.Redis, key: str, cluster: LocalCluster, budget: Budget, cap_s: float
) -> None:
    """Return once round 0 is committed; fail if the coordinator ends or time runs out."""
    deadline = time.monotonic() + budget.left(cap_s)
    while client.xlen(key) == 0:
        if cluster.procs["coordinator"].poll() is not None:
            raise RuntimeError(
                f"job ended before its first round:\n{cluster.log_tail('coordinator')}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"no round committed within {cap_s:.0f} s ({budget}):\n"
                f"{cluster.log_tail('coordinator')}"
            )
        time.sleep(POLL_S)


def run(redis_url: str, rounds: int, rate: float | None, flood_s: float, budget: Budget) -> Run:
    """One job of `rounds` rounds, flooded for `flood_s` after round 0 if `rate` is given."""
    cluster_name = f"bench-flood-{uuid.uuid4().hex[:8]}"
    result = Run(flooded=rate is not None)
    client = redis.Redis.from_url(redis_url)
    stop, sent = threading.Event(), [0]
    flooder: threading.Thread | None = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cluster = LocalCluster(Path(tmp), redis_url, cluster_name, budget=budget)
            try:
                store = Store(redis_url, cluster_name)
                key = store.key("metrics", JOB_ID)
                store.close()
                job = {"job_id": JOB_ID, "model": {"name": "small_cnn"}, "seed": 7}
                job |= {"rounds": rounds, "optimizer": SGD}
                plan = {"global_batch": 32, "microbatches": 4, "stages": STAGES}
                cluster.start_workers(["a", "b", "c"])
                cluster.start_coordinator(job, plan)
                window = (math.inf, -math.inf)
                if rate is not None:
                    _wait_first_round(client, key, cluster, budget, 300)
                    flooder = threading.Thread(
                        target=flood, args=(cluster.addr, rate, stop, sent), daemon=True
                    )
                    began = time.time()
                    flooder.start()
                    # the flood lasts `flood_s`, or until the job ends, if sooner
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        cluster.procs["coordinator"].wait(timeout=budget.left(flood_s))
                    stop.set()
                    flooder.join(timeout=STOP_FLOOD_S)
                    window = (began, time.time())
                    result.flood_s = window[1] - window[0]
                code = cluster.wait("coordinator", 600)
                if code != 0:
                    raise RuntimeError(
                        f"job failed (exit {code}):\n{cluster.log_tail('coordinator')}"
                    )
                commits = _commits(client, key)[1:]  # round 0 warms up
                if rate is None:
                    result.rounds = [s for _, s in commits]
                else:
                    result.rounds = [s for t, s in commits if t - s >= window[0] and t <= window[1]]
                result.sent = sent[0]
                return result
            finally:
                stop.set()
                if flooder is not None and flooder.is_alive():
                    flooder.join(timeout=STOP_FLOOD_S)
                cluster.close()
    finally:
        keys = list(client.scan_iter(match=f"asteroid:{cluster_name}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


# --- report -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One line of the table: the counted rounds of every run of a case."""

    name: str
    runs: list[Run]
    base: float  # median round seconds undisturbed

    @property
    def rounds(self) -> list[float]:
        return [s for r in self.runs for s in r.rounds]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def ratio(self) -> float:
        return self.median / self.base

    @property
    def sent(self) -> int:
        return sum(r.sent for r in self.runs)

    @property
    def flood_s(self) -> float:
        return sum(r.flood_s for r in self.runs)


HEADERS = (
    "case",
    "runs",
    "rounds",
    "median round",
    "mean round",
    "p90 round",
    "ratio",
    "target",
    "met",
    "flood s",
    "heartbeats/s sent",
)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def _cells(case: Case) -> list[str]:
    flooded = case.name == "flood"
    return [
        case.name,
        str(len(case.runs)),
        str(len(case.rounds)),
        f"{case.median * 1e3:.1f} ms",
        f"{statistics.fmean(case.rounds) * 1e3:.1f} ms",
        f"{_p90(case.rounds) * 1e3:.1f} ms",
        f"{case.ratio:.2f}",
        f"< {TARGET:.2f}" if flooded else "-",
        ("yes" if case.ratio < TARGET else "NO") if flooded else "-",
        f"{case.flood_s / len(case.runs):.1f}" if flooded else "-",
        f"{case.sent / case.flood_s:,.0f}" if flooded and case.flood_s > 0 else "-",
    ]


def write_markdown(path: Path, cases: list[Case], command: str, args: argparse.Namespace) -> None:
    lines = [
        "# Heartbeat-flood benchmark",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: nproc {len(os.sched_getaffinity(0))}, load average "
        f"{os.getloadavg()[0]:.1f} at the end (other work on the machine skews the ratio)",
        f"- small_cnn, 2 stages on 3 local workers, a real coordinator; {args.repeats} runs "
        f"per case, alternating; undisturbed runs of {args.rounds} rounds",
        f"- flood: {args.rate:,.0f} heartbeats/s from one id for {args.flood_s:g} s after "
        "round 0; only rounds wholly inside the flood count; round 0 never counts",
        "- ratio = median round time of the case / median undisturbed round time",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
        *("| " + " | ".join(_cells(c)) + " |" for c in cases),
        "",
    ]
    path.write_text("\n".join(lines))


def _record(c: Case) -> dict[str, object]:
    cells = _cells(c)
    return {
        "case": c.name,
        "runs": len(c.runs),
        "rounds": len(c.rounds),
        "median_round_s": f"{c.median:.6g}",
        "mean_round_s": f"{statistics.fmean(c.rounds):.6g}",
        "p90_round_s": f"{_p90(c.rounds):.6g}",
        "ratio": f"{c.ratio:.4f}",
        "target": cells[7],
        "met": cells[8],
        "flood_s": f"{c.flood_s:.3f}",
        "heartbeats_sent": c.sent,
    }


def write_csv(path: Path, cases: list[Case]) -> None:
    records = [_record(c) for c in cases]
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=list(records[0]))
        out.writeheader()
        out.writerows(records)


def print_table(cases: list[Case]) -> None:
    widths = [max(len(h), *(len(_cells(c)[i]) for c in cases)) for i, h in enumerate(HEADERS)]
    for row in (list(HEADERS), *(_cells(c) for c in cases)):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


# --- main -------------------------------------------------------------------------


@contextlib.contextmanager
def _redis(url: str) -> Iterator[str]:
    """`url` if a Redis answers there, else an embedded one for the run (stopped after)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
        answers = True
    except redis.RedisError:
        answers = False
    finally:
        client.close()
    if answers:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


def _sigterm(signum: int, _frame: FrameType | None) -> None:
    """Turn SIGTERM into SystemExit so every `finally` stops its children."""
    raise SystemExit(128 + signum)


def measure(args: argparse.Namespace, redis_url: str) -> list[Case]:
    """Both cases alternately: the flooded job is sized from the first undisturbed one."""
    budget = Budget(args.deadline_s)
    runs: list[Run] = []
    flood_rounds = 0
    for rep in range(args.repeats):
        for flooded in (False, True) if rep % 2 == 0 else (True, False):
            if flooded:
                runs.append(run(redis_url, flood_rounds, args.rate, args.flood_s, budget))
                continue
            runs.append(run(redis_url, args.rounds, None, args.flood_s, budget))
            if not runs[-1].rounds:
                raise RuntimeError("the undisturbed job committed no round after round 0")
            if not flood_rounds:  # enough to outlast the flood even if it slows nothing
                base = statistics.median(runs[-1].rounds)
                flood_rounds = 2 + math.ceil(1.2 * args.flood_s / base)
    calm = [r for r in runs if not r.flooded]
    stormy = [r for r in runs if r.flooded]
    if not any(r.rounds for r in stormy):
        raise RuntimeError("no round ran wholly inside a flood; is --flood-s too short?")
    base = statistics.median(s for r in calm for s in r.rounds)
    return [Case("undisturbed", calm, base), Case("flood", stormy, base)]


def main(argv: list[str] | None = None) -> int:
    """Run both cases, print the table and write it to `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write flood.{md,csv} here")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of an undisturbed job")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case")
    parser.add_argument("--rate", type=float, default=50_000.0, help="heartbeats a second")
    parser.add_argument("--flood-s", type=float, default=10.0, help="seconds of each flood")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=900.0,
        help="cap on all runs together (stopping the children of the last adds up to 25 s)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.repeats < 1 or args.rate <= 0 or args.flood_s <= 0:
        parser.error("need --rounds >= 2, --repeats >= 1, --rate > 0 and --flood-s > 0")
    signal.signal(signal.SIGTERM, _sigterm)
    command = " ".join(["python -m tests.bench.bench_flood", *(argv or sys.argv[1:])])
    start = time.monotonic()
    try:
        with _redis(os.environ.get("ASTEROID_REDIS_URL", "redis://127.0.0.1:6379/0")) as url:
            cases = measure(args, url)
    except (RuntimeError, AssertionError, StoreError, redis.RedisError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    print(f"heartbeat flood: {args.rate:,.0f}/s from one id for {args.flood_s:g} s")
    print_table(cases)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_markdown(args.out / "flood.md", cases, command, args)
        write_csv(args.out / "flood.csv", cases)
        print(f"wrote {args.out}/flood.{{md,csv}} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
