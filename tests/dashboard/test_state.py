"""The dashboard's JSON state and its Prometheus collector, over records the real writers wrote."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.extras import MissingExtraError, require
from common.messages import Heartbeat
from common.plan import Plan
from common.records.devices import write_device
from common.records.documents import put_plan
from common.records.events import append_event
from common.records.jobs import commit_round, index_job, write_job, write_job_state
from common.store import Store
from services.dashboard.prometheus import registry_for
from services.dashboard.state import ClusterReader, accelerator_of, safe_state
from services.dashboard.tails import Histogram, JobTail, fold_events, fold_metrics

PLAN = {
    "global_batch": 32,
    "microbatches": 4,
    "stages": [
        {"start": 0, "end": 3, "devices": [{"device": "a", "share": 1}]},
        {"start": 3, "end": 7, "devices": [{"device": "b", "share": 2}, {"device": "c"}]},
    ],
}


def _heartbeat(store: Store, device: str, seen: float) -> None:
    hb = Heartbeat(
        device=device,
        data_addr="tcp://127.0.0.1:1",
        memory_budget=2 << 30,
        stage=0,
        fingerprint="x86_64-4c-1t-7.8g-0123456789",
    )
    write_device(store, hb, seen, ttl_s=60)


def _round(store: Store, jid: str, r: int, loss: float, round_s: float = 0.5) -> None:
    entry = {
        "round": r,
        "epoch": 0,
        "loss": loss,
        "round_s": round_s,
        "samples_per_s": 64.0,
        "devices": {"a": {"stage": 0}, "b": {"stage": 1}},
    }
    commit_round(
        store,
        jid,
        {"round": r + 1, "loss": loss, "samples_per_s": 64.0},
        {"metrics": (entry, 10000)},
        time.time(),
    )


@pytest.fixture
def job(store: Store) -> str:
    """A running job of 3 committed rounds, a recovery and a checkpoint, on devices a, b, c."""
    now = time.time()
    for name, age in (("a", 0.2), ("b", 0.5), ("c", 30.0)):
        _heartbeat(store, name, now - age)
    write_job(store, "j1", submitted=now - 10, total_rounds=20)
    index_job(store, "j1", now - 10)
    write_job_state(store, "j1", "running")
    put_plan(store, "j1", Plan.model_validate(PLAN))
    for r, loss in enumerate((2.3, 2.1, 1.9)):
        _round(store, "j1", r, loss)
    append_event(store, "j1", "recovered", lost=["c"], stages=[[0, 3, ["a"]], [3, 7, ["b"]]])
    store.append("events", "j1", {"event": "checkpoint", "round": 2})
    return "j1"


def test_the_state_shows_devices_the_plan_rounds_and_recoveries(store, cluster_name, job):
    reader = ClusterReader(store, cluster_name, stale_after_s=3.0)
    s = reader.state()
    devices = {d["device"]: d for d in s["devices"]}
    assert [d["device"] for d in s["devices"]] == ["a", "b", "c"]  # freshest first
    assert devices["a"]["up"] and devices["b"]["up"] and not devices["c"]["up"]
    assert devices["c"]["age_s"] == pytest.approx(30.0, abs=5)
    assert devices["a"]["memory_budget"] == 2 << 30 and devices["a"]["accelerator"] == "cpu"
    assert [j["job"] for j in s["jobs"]] == ["j1"]
    detail = s["job"]
    assert (detail["job"], detail["state"], detail["round"]) == ("j1", "running", 3)
    stages = detail["plan"]["stages"]
    assert [st["layers"] for st in stages] == [[0, 3], [3, 7]]
    assert stages[1]["devices"] == [{"device": "b", "share": 2}, {"device": "c", "share": 1}]
    assert [p["loss"] for p in detail["series"]] == [2.3, 2.1, 1.9]
    assert detail["samples"] == pytest.approx(3 * 0.5 * 64)
    assert [e["event"] for e in detail["events"]][-2:] == ["recovered", "checkpoint"]
    assert detail["events"][-2]["lost"] == ["c"] and detail["recoveries"] == 1
    assert detail["serving"] is None


def test_later_looks_read_only_what_is_new_and_a_replaced_job_starts_over(store, cluster_name, job):
    reader = ClusterReader(store, cluster_name, stale_after_s=3.0)
    assert len(reader.state()["job"]["series"]) == 3
    _round(store, job, 3, 1.7)
    append_event(store, job, "replanned", reason="device d joined")
    again = reader.state()["job"]
    assert [p["round"] for p in again["series"]] == [0, 1, 2, 3]
    assert (again["recoveries"], again["replans"]) == (1, 1)
    # the operator replaces the job: new submission time, fresh streams
    for stream in ("metrics", "events"):
        store.delete(store.key(stream, job))
    write_job(store, job, submitted=time.time())
    _round(store, job, 0, 2.2)
    fresh = reader.state()["job"]
    assert [p["loss"] for p in fresh["series"]] == [2.2]
    assert (fresh["recoveries"], fresh["replans"]) == (0, 0)


def test_a_job_is_chosen_by_a_checked_id_only(store, cluster_name, job):
    reader = ClusterReader(store, cluster_name, stale_after_s=3.0)
    assert safe_state(reader, "j1")[1]["job"]["job"] == "j1"
    assert safe_state(reader, "nope")[1]["job"] is None
    for bad in ("*", "j1*", "../x", "a" * 65, "j1:plan"):
        status, body = safe_state(reader, bad)
        assert status == 400 and "job_id from the dashboard's ?job=" in body["error"], bad


def test_redis_away_is_a_503_naming_it(cluster_name):
    dead = Store("redis://127.0.0.1:9/0", cluster_name, timeout_s=1, connect_timeout_s=1)
    status, body = safe_state(ClusterReader(dead, cluster_name, 3.0), None)
    assert status == 503 and body["redis"] == "redis://127.0.0.1:9/0" and body["error"]
    families = {
        f.name: f
        for f in text_string_to_metric_families(
            generate_latest(registry_for(ClusterReader(dead, cluster_name, 3.0))).decode()
        )
    }
    assert [s.value for s in families["asteroid_redis_up"].samples] == [0.0]


def _scrape(reader: ClusterReader) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry_for(reader)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_collector_reads_the_same_records_with_prometheus_names(store, cluster_name, job):
    reader = ClusterReader(store, cluster_name, stale_after_s=3.0)
    m = _scrape(reader)
    j = (("job", "j1"),)
    assert m[("asteroid_redis_up", ())] == 1.0
    assert m[("asteroid_rounds_committed_total", j)] == 3
    assert m[("asteroid_samples_total", j)] == pytest.approx(96)
    assert m[("asteroid_recoveries_total", j)] == 1 and m[("asteroid_replans_total", j)] == 0
    assert m[("asteroid_round_duration_seconds_count", j)] == 3
    assert m[("asteroid_round_duration_seconds_bucket", (*j, ("le", "0.5")))] == 3
    assert m[("asteroid_round_duration_seconds_bucket", (*j, ("le", "0.25")))] == 0
    assert m[("asteroid_loss", j)] == pytest.approx(1.9)
    assert m[("asteroid_job_state", (*j, ("state", "running")))] == 1
    assert m[("asteroid_device_up", (("device", "a"),))] == 1
    assert m[("asteroid_device_up", (("device", "c"),))] == 0
    assert m[("asteroid_device_heartbeat_age_seconds", (("device", "c"),))] > 20
    _round(store, job, 3, 1.7, round_s=2.0)
    after = _scrape(reader)
    assert after[("asteroid_rounds_committed_total", j)] == 4
    assert after[("asteroid_round_duration_seconds_bucket", (*j, ("le", "2.5")))] == 4
    assert after[("asteroid_samples_total", j)] == pytest.approx(96 + 128)


def test_serving_requests_show_as_requests_and_latencies(store, cluster_name):
    write_job(store, "srv", submitted=time.time(), kind="serve")
    index_job(store, "srv")
    write_job_state(store, "srv", "running")
    for n, latency in enumerate((0.02, 0.04, 0.3)):
        store.append(
            "metrics",
            "srv",
            {
                "request": n,
                "latency_s": latency,
                "compute_s": 0.01,
                "queued_s": 0.0,
                "tokens_in": 3,
                "tokens_out": 8,
            },
        )
    reader = ClusterReader(store, cluster_name, stale_after_s=3.0)
    serving = reader.state("srv")["job"]["serving"]
    assert serving["requests"] == 3 and serving["p50_le_s"] == 0.05
    assert [r["latency_s"] for r in serving["recent"]] == [0.02, 0.04, 0.3]
    m = _scrape(reader)
    assert m[("asteroid_inference_requests_total", (("job", "srv"),))] == 3
    assert m[("asteroid_inference_latency_seconds_bucket", (("job", "srv"), ("le", "0.05")))] == 2
    assert ("asteroid_rounds_committed_total", (("job", "srv"),)) not in m


def test_folds_ignore_what_no_coordinator_writes():
    tail = JobTail()
    fold_metrics(
        tail,
        [
            (1.0, {"round_s": "slow"}),
            (2.0, {"round_s": float("nan")}),
            (3.0, {"latency_s": True}),
            (4.0, {"eval_accuracy": 0.5}),
        ],
    )
    fold_events(tail, [(1.0, {"event": 3}), (2.0, {"no": "event"})])
    assert (len(tail.series), tail.rounds.count, tail.latency.count, len(tail.events)) == (0,) * 4


def test_histogram_buckets_are_cumulative_with_inf_last():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 9.0):
        h.observe(v)
    assert h.cumulative() == [("1.0", 2.0), ("2.0", 3.0), ("+Inf", 4.0)]
    assert h.quantile(0.5) == 1.0 and h.quantile(1.0) == float("inf")
    assert Histogram((1.0,)).quantile(0.5) is None


@pytest.mark.parametrize(
    ("fingerprint", "accelerator"),
    [
        ("x86_64-4c-1t-7.8g-0123456789", "cpu"),
        ("x86_64-4c-1t-q2-7.8g-0123456789", "cpu"),
        ("aarch64-6c-6t-cuda_Orin-7.4g-0123456789", "cuda_Orin"),
        (
            "x86_64-16c-8t-q8-cuda_NVIDIA_H100_80GB_HBM3-79.1g-0123456789",
            "cuda_NVIDIA_H100_80GB_HBM3",
        ),
        ("", "?"),
    ],
)
def test_the_accelerator_is_read_from_the_fingerprint(fingerprint, accelerator):
    assert accelerator_of(fingerprint) == accelerator


def test_a_missing_dashboard_module_names_the_dashboard_extra(monkeypatch):
    import importlib

    def missing(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(MissingExtraError, match=r"pip install 'asteroid-edge\[dashboard\]'"):
        require("uvicorn", "the dashboard", "dashboard")
    with pytest.raises(KeyError):
        require("jinja2", "the dashboard", "dashboard")
