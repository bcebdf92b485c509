"""End to end on emulated devices: services up, a planned job trains, nothing is left after."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from common.job import JobSpec
from common.messages import SubmitJob
from common.store import Store
from services.cli.client import ask_coordinator
from services.cli.follow import follow
from services.testbed.bed import Testbed
from services.testbed.spec import load_testbed
from tests.testbed.traces import alive, traces

pytestmark = [pytest.mark.integration, pytest.mark.slow]

THREE = Path(__file__).resolve().parents[2] / "deploy" / "testbed" / "three-devices.yaml"
JOB = {
    "job_id": "testbed-e2e",
    "model": {"name": "small_cnn"},
    "global_batch": 24,
    "micro_batch": 8,
    "rounds": 3,
    "planner": "asteroid",
    "min_workers": 3,
    "seed": 1,
}


@pytest.mark.timeout(900)
def test_three_devices_train_a_planned_job_and_leave_nothing(tmp_path, subnet, tag, monkeypatch):
    spec = load_testbed(THREE).model_copy(update={"subnet": subnet})
    tb = Testbed(spec, tmp_path / "logs", tag=tag, heartbeat_s=0.5)
    pids: list[int] = []
    with tb:
        tb.up(services=True, ready_timeout_s=400)
        monkeypatch.setenv("ASTEROID_KEYS", str(tb.keys))  # the testbed's operator submits
        pids = tb.pids()
        job = JobSpec.model_validate(JOB)
        reply = ask_coordinator(tb.coordinator, SubmitJob(job=job), timeout_s=60)
        assert reply.ok, reply.error
        store = Store(tb.redis_url, tb.cluster)
        try:
            view = follow(store, job.job_id, Console(file=io.StringIO()), timeout_s=600)
            assert view.state == "finished", (view.error, tb.tail("coordinator", 40))
            assert len(view.rounds) == 3
            cluster = store.get_json("cluster", job.job_id)
            assert sorted(d["name"] for d in cluster["devices"]) == ["fast-0", "fast-1", "slow-0"]
            # the planner saw the testbed's links: 100 Mbit/s each way, in bytes/s
            assert set(cluster["links"].values()) == {100e6 / 8}
            # two kinds of device, so two profiles, each measured inside its device
            assert len(list(store.keys("profile", ""))) == 2
        finally:
            store.close()
        tb.check()
        for dev in tb.devices:
            assert tb.oom_kills(dev) == 0
            assert tb.peak_memory(dev) > 100 << 20
    assert traces(tag) == []
    assert len(pids) == 2 + 2 * 3 + 1  # coordinator, planner, per device 2, Redis
    assert not any(alive(p) for p in pids)
