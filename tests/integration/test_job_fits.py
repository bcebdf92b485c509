"""The example job on a real local stack of three workers: it fits, and a wait shows.

Every service is a real process on the tests' Redis. The shipped example job,
asked for four workers, waits visibly ("waiting for workers 3/4 (dev-0, dev-1,
dev-2)") and fails naming the three it had; the example as shipped (no
`min_workers`) is then submitted again under the same id, which is accepted
because the first run never committed a round, and trains on all three.
Once that run has rounds, the id is refused with the way out.
"""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from common.job import JobSpec, load_job
from common.messages import SubmitJob
from common.records.devices import read_devices
from common.records.documents import read_plan
from common.store import Store
from services.cli.client import ask_coordinator
from services.cli.example_files import DEMO_JOB, example_path
from services.cli.follow import follow
from services.launcher import LocalStack
from tests.cluster import Budget

pytestmark = pytest.mark.integration

WORKERS = ["dev-0", "dev-1", "dev-2"]


def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting {timeout_s:.0f} s for {what}"
        time.sleep(0.2)


def _example() -> JobSpec:
    """The shipped example, shortened to a few rounds (its other keys as shipped)."""
    with example_path(DEMO_JOB) as path:
        job = load_job(path)
    short = {"rounds": 4, "eval_every": 0, "checkpoint_every": 0}
    return JobSpec.model_validate({**job.model_dump(), **short})


@pytest.fixture
def stack(tmp_path, redis_url, cluster_name, monkeypatch):
    monkeypatch.setenv("ASTEROID_JOIN_TIMEOUT_S", "10")  # the wait for a 4th worker: short
    with LocalStack(3, tmp_path / "logs", redis_url, cluster_name, heartbeat_s=0.3) as s:
        yield s


def test_the_example_job_runs_on_the_three_workers_present_after_a_visible_wait(
    stack, redis_url, cluster_name, budget: Budget
):
    store = Store(redis_url, cluster_name)
    try:
        _until(
            lambda: sorted(d.device for d in read_devices(store)) == WORKERS,
            budget.left(90),
            "the three workers to join",
        )
        job = _example()
        assert job.min_workers is None

        # asked for four: the wait shows 3/4 with their names, and its failure says so
        four = job.model_copy(update={"min_workers": 4})
        reply = ask_coordinator(stack.coordinator, SubmitJob(job=four), budget.left(60))
        assert reply.ok, reply.error
        out = io.StringIO()
        view = follow(store, job.job_id, Console(file=out, width=200), budget.left(60))
        assert view.state == "failed", (view, stack.tail("coordinator"))
        assert "waiting for workers 3/4 (dev-0, dev-1, dev-2)" in out.getvalue(), out.getvalue()
        assert view.error.startswith("min_workers: 4 workers wanted, 3 joined and vetted")
        assert "['dev-0', 'dev-1', 'dev-2']" in view.error

        # as shipped, under the same id: the run that never ran is replaced; it runs on 3
        reply = ask_coordinator(stack.coordinator, SubmitJob(job=job), budget.left(60))
        assert reply.ok, reply.error
        view = follow(store, job.job_id, Console(file=io.StringIO()), budget.left(150))
        assert view.state == "finished", (view, stack.tail("coordinator"))
        assert len(view.rounds) == 4
        plan = read_plan(store, job.job_id)
        assert plan is not None
        assert sorted(a.device for s in plan.stages for a in s.devices) == WORKERS

        # a run with committed rounds is kept: the refusal names the way out
        reply = ask_coordinator(stack.coordinator, SubmitJob(job=job), budget.left(30))
        assert not reply.ok
        assert "exists (finished)" in reply.error and "--replace" in reply.error
    finally:
        store.close()
