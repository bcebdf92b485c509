"""A cluster of real processes with `asteroid-dashboard` beside it, and bounded looks at it."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import LocalCluster

MODEL = {"name": "small_cnn"}
SGD = {"kind": "sgd", "lr": 0.01, "momentum": 0.9}


def job_spec(jid: str, rounds: int, **extra: Any) -> dict[str, Any]:
    """A small CNN on synthetic data, checkpointed every 2 rounds (recovery needs one)."""
    return {
        "job_id": jid,
        "model": MODEL,
        "seed": 3,
        "rounds": rounds,
        "optimizer": SGD,
        "dataset": {"kind": "synthetic"},
        "checkpoint_every": 2,
        **extra,
    }


def until(pred: Callable[[], Any], timeout_s: float, what: str, why: Callable[[], str]) -> Any:
    """`pred()`'s first truthy value, polled every 0.2 s for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}:\n{why()}"
        time.sleep(0.2)


def start_dashboard(cluster: LocalCluster, timeout_s: float) -> str:
    """Start `asteroid-dashboard` on a free port of loopback; its URL once it listens."""
    proc = cluster.spawn("dashboard", ["-m", "services.dashboard.main", "--http-port", "0"])

    def listening() -> str | None:
        assert proc.poll() is None, cluster.log_tail("dashboard")
        for e in cluster.log_events("dashboard"):
            if e.get("event") == "dashboard listening":
                return str(e["url"])
        return None

    return str(until(listening, timeout_s, "the dashboard", lambda: cluster.log_tail("dashboard")))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """/metrics, parsed by prometheus_client's own text parser."""
    with urllib.request.urlopen(url + "metrics", timeout=10) as res:
        text = res.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
