"""Local quick start: a whole cluster on this machine, one short job, then clean up.

Starts an embedded Redis unless ASTEROID_REDIS_URL is set, five worker
processes on loopback, and the coordinator in this process; runs the example
job with the example hybrid plan (2 devices 5:3 -> 1 device -> 2 devices 1:1)
and prints a summary. Ctrl-C stops everything.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from common.embedded_redis import EmbeddedRedis
from common.job import load_job
from common.logging import configure_logging
from common.plan import load_plan
from common.settings import CoordinatorSettings
from services.coordinator.service import Coordinator, JobSummary

__all__ = ["main"]

EXAMPLES = Path(__file__).resolve().parent.parent / "deploy" / "examples"


@contextlib.contextmanager
def _redis() -> Iterator[str]:
    url = os.environ.get("ASTEROID_REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


@contextlib.contextmanager
def _workers(names: Sequence[str], env: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen([sys.executable, "-m", "services.worker.main", "--device", n], env=env)
        for n in names
    ]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _summary(console: Console, s: JobSummary, batch: int) -> None:
    table = Table(title=f"job {s.job_id}: {s.rounds} rounds of {batch} samples")
    for col in ("", "first 5 rounds", "last 5 rounds"):
        table.add_column(col)

    def avg(xs: list[float]) -> str:
        return f"{sum(xs) / len(xs):.3f}"

    table.add_row("loss", avg(s.losses[:5]), avg(s.losses[-5:]))
    table.add_row("train accuracy", avg(s.accuracies[:5]), avg(s.accuracies[-5:]))
    rs = s.round_s[1:] or s.round_s
    table.add_row(
        "samples/s",
        f"{batch / (sum(s.round_s[:5]) / 5):.0f}",
        f"{batch * len(rs[-5:]) / sum(rs[-5:]):.0f}",
    )
    console.print(table)
    console.print(
        f"checkpoints committed at rounds {s.checkpoints}; peak activations alive "
        f"per worker {s.max_alive}"
    )


def main() -> None:
    """Entry point of `python -m services.quickstart` (`make demo`)."""
    console = Console()
    job = load_job(EXAMPLES / "job-small-cnn.yaml")
    plan = load_plan(EXAMPLES / "plan-hybrid-5.json")
    configure_logging("info", "console")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    try:
        with _redis() as url:
            console.print(f"Redis at {url}; starting {len(plan.devices)} workers")
            env = {
                **os.environ,
                "ASTEROID_REDIS_URL": url,
                "ASTEROID_COORDINATOR": addr,
                "ASTEROID_CLUSTER": "quickstart",
                "ASTEROID_THREADS": "1",
                "ASTEROID_LOG_LEVEL": "warning",
            }
            settings = CoordinatorSettings(redis_url=url, bind=addr, cluster="quickstart")
            with _workers(plan.devices, env):
                coord = Coordinator(settings)
                try:
                    coord.store.delete_prefix("")
                    summary = coord.run_job(job, plan)
                    coord.shutdown_workers("quick start finished")
                finally:
                    coord.close()
            _summary(console, summary, plan.global_batch)
    except KeyboardInterrupt:
        console.print("interrupted; everything stopped")
        sys.exit(130)


if __name__ == "__main__":
    main()
