"""A short seeded chaos run on loopback: six membership events, nothing lost.

The shape of the full run (`python -m tests.chaos.run`, `make chaos` on the
testbed) at the size of the default suite: real coordinator, workers,
profiler, planner and a redis-server with its append-only file, all on
127.0.0.1. The seeded schedule kills a stage with its backup, kills a third
device while that recovery is under way, restarts the coordinator with
--resume, lets a device join, hangs one (SIGSTOP, SIGCONT after the hold) and
SIGKILLs Redis, restarted from its AOF. At the end every invariant must hold:
the job finished, every sample of every epoch trained exactly once, the final
weights equal single-process training (Adam, lr 1e-5) within 1e-6, no process
grew (RSS, fds, threads), every device process exited, and every event was
recovered from. The report (table, plot) is written under the test's tmp_path.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

import pytest

from tests.chaos.backend import Kind
from tests.chaos.invariants import GrowthRule
from tests.chaos.loopback import LoopbackBackend
from tests.chaos.run import chaos_run
from tests.cluster import Budget

pytestmark = pytest.mark.integration

SEED = 17
EVENTS = 6
KINDS: list[Kind] = [
    "kill_stage",
    "second_kill",
    "stop_cont",
    "join",
    "drain",
    "coordinator_restart",
    "redis_restart",
]
"""A plain kill is the second kill's; a drain is drawn when the seed has room for it."""
DEVICES = ["a", "b", "c", "d", "e"]
SHORT_RUN = GrowthRule(warmup_s=5.0, window=3, min_life_s=10.0)
"""Growth judged at the size of this run: on an unloaded machine the whole run takes under a
minute and sampling starts once the cluster is up, so the full run's rule (30 s of life after
a 10 s warm-up) judged no process at all, which is no evidence and fails the check. The
margins stay the full run's."""
AFTER_S = 45.0
"""Kept from the budget for what follows the run: the reference training, the report."""


def test_a_short_seeded_chaos_run_loses_nothing(tmp_path: Path, budget: Budget) -> None:
    out = tmp_path / "chaos"
    cluster = f"chaos-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []

    def backend(spares: int) -> LoopbackBackend:
        env = {"ASTEROID_REDIS_OUTAGE_S": "90"}
        return LoopbackBackend(out, cluster, env=env, budget=budget, spares=spares)

    outcome = chaos_run(
        backend,
        SEED,
        EVENTS,
        devices=DEVICES,
        need=2,
        kinds=KINDS,
        deadline=time.time() + budget.left(math.inf) - AFTER_S,
        per_event=5,  # a loopback event takes a few rounds; fewer rounds, a shorter test
        rule=SHORT_RUN,
        log=lines.append,
    )
    kinds = [e.kind for e in outcome.result.schedule.events]
    assert {"kill_stage", "second_kill", "coordinator_restart", "redis_restart"} <= set(kinds)
    assert outcome.ok, (
        outcome.failures() + "\n" + "\n".join(lines) + "\n" + outcome.report.read_text()
    )
