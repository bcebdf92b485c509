"""The typed records against a real Redis: each written, read back as its model."""

import time

import pytest
from pydantic import ValidationError

from common.errors import ConfigError, StoreError
from common.messages import Heartbeat
from common.plan import Plan
from common.records.counters import raise_fence, raise_plan_epoch
from common.records.devices import forget_devices, read_devices, write_device
from common.records.documents import put_jobspec, put_plan, read_jobspec, read_plan
from common.records.events import append_event, read_events_after
from common.records.federation import count_start, forget_federation
from common.records.jobs import (
    JobRecord,
    commit_round,
    forget_job,
    index_job,
    job_state,
    read_job,
    recent_jobs,
    write_job,
    write_job_state,
)
from common.records.metrics import read_metrics, read_metrics_after


def test_job_state_is_written_to_hash_and_events(store):
    assert read_job(store, "j1") is None
    assert job_state(store, "j1") is None
    write_job(store, "j1", state="submitted", submitted=1.0, total_rounds=3, round=0)
    write_job_state(store, "j1", "profiling", workers=["a", "b"])
    job = read_job(store, "j1")
    assert job is not None
    assert (job.state, job.total_rounds, job.round, job.workers) == ("profiling", 3, 0, ["a", "b"])
    assert job.updated is not None and job.updated <= time.time()
    events, after = read_events_after(store, "j1", "0")
    assert [(e.event, e.workers) for e in events] == [("profiling", ["a", "b"])]
    assert read_events_after(store, "j1", after) == ([], after)
    append_event(store, "j1", "checkpoint", round=2)
    (checkpoint,), _ = read_events_after(store, "j1", after)
    assert (checkpoint.event, checkpoint.round) == ("checkpoint", 2)
    write_job_state(store, "j1", "failed", error="boom")
    assert read_job(store, "j1").note == "boom"


def test_an_older_record_with_an_unknown_field_loads(store):
    store.set_fields({"state": "finished", "round": 4, "legacy_field": {"x": 1}}, "job", "old")
    job = read_job(store, "old")
    assert isinstance(job, JobRecord) and job.state == "finished" and job.round == 4
    assert job.model_extra == {"legacy_field": {"x": 1}}
    assert job.fields() == {"state": "finished", "round": 4, "legacy_field": {"x": 1}}


def test_a_malformed_record_is_named(store):
    store.set_fields({"state": "running", "round": "many"}, "job", "bad")
    with pytest.raises(StoreError, match="job bad's record"):
        read_job(store, "bad")


def test_writers_refuse_unknown_or_mistyped_fields(store):
    with pytest.raises(ValueError, match="no field speling"):
        write_job_state(store, "j", "running", speling=1)
    with pytest.raises(ValidationError):
        write_job(store, "j", round="three")
    assert read_job(store, "j") is None


@pytest.mark.parametrize("jid", ["a*", "a:b", "", "-x", "[ab]"])
def test_keys_come_only_from_checked_ids(store, jid):
    with pytest.raises(ConfigError, match="job_id"):
        read_job(store, jid)
    with pytest.raises(ConfigError, match="job_id"):
        write_job_state(store, jid, "running")


def test_commit_round_sets_hash_and_metrics_together(store):
    commit_round(
        store,
        "j",
        {"round": 1, "loss": 0.5},
        {"metrics": ({"round": 0, "loss": 0.5, "accuracy": 0.25}, 100)},
        now=12.5,
    )
    job = read_job(store, "j")
    assert (job.round, job.loss, job.updated) == (1, 0.5, 12.5)
    entries = read_metrics(store, "j")
    assert [(m.round, m.loss, m.accuracy) for m in entries] == [(0, 0.5, 0.25)]
    new, after = read_metrics_after(store, "j", "0")
    assert [m.loss for m in new] == [0.5] and read_metrics_after(store, "j", after)[0] == []


def test_a_metrics_entry_without_time_gets_its_stream_id(store):
    before = time.time()
    store.append("metrics", "j", {"round": 0, "loss": 1.0, "extra_metric": 7})
    (entry,) = read_metrics(store, "j")
    assert before - 1 <= entry.time <= time.time() + 1
    assert entry.fields()["extra_metric"] == 7 and set(entry.fields()) == {
        "round",
        "loss",
        "extra_metric",
        "time",
    }


def test_index_lists_newest_first(store):
    index_job(store, "first", 1.0)
    index_job(store, "second", 2.0)
    index_job(store, "first", 3.0)
    assert recent_jobs(store) == ["first", "second"]
    assert recent_jobs(store, 1) == ["first"]
    store.add_ranked("bad:id*", 9.0, "jobs")  # no coordinator writes this
    assert recent_jobs(store) == ["first", "second"]


def test_forget_job_deletes_its_keys_only(store):
    write_job_state(store, "gone", "finished")
    store.append("metrics", "gone", {"round": 0})
    store.put_json({"round": 1}, "ckpt", "gone", 1, "manifest")
    write_job_state(store, "gone2", "finished")
    forget_job(store, "gone")
    assert read_job(store, "gone") is None
    assert read_metrics(store, "gone") == []
    assert list(store.keys("ckpt", "gone", "")) == []
    assert job_state(store, "gone2") == "finished"


def test_devices_expire_list_freshest_first_and_are_forgotten(store):
    write_device(store, Heartbeat(device="old", data_addr="tcp://a:1"), seen=1.0, ttl_s=60)
    write_device(store, Heartbeat(device="new", data_addr="tcp://b:1"), seen=2.0, ttl_s=60)
    assert 0 < store.r.pttl(store.key("device", "new")) <= 60_000
    devices = read_devices(store)
    assert [(d.device, d.seen, d.data_addr, d.stage) for d in devices] == [
        ("new", 2.0, "tcp://b:1", -1),
        ("old", 1.0, "tcp://a:1", -1),
    ]
    store.set_fields({"seen": 3.0, "state": "idle", "retired": True}, "device", "legacy")
    assert read_devices(store)[0].device == "legacy"
    assert forget_devices(store, ["old", "legacy", "never"]) == 2
    assert [d.device for d in read_devices(store)] == ["new"]
    assert forget_devices(store, []) == 0


def test_counters_only_grow(store):
    assert [raise_fence(store), raise_fence(store)] == [1, 2]
    assert raise_plan_epoch(store) == 1


def test_documents_round_trip(store):
    assert read_plan(store, "j") is None and read_jobspec(store, "j") is None
    put_jobspec(store, "j", {"job_id": "j", "rounds": 2})
    assert read_jobspec(store, "j") == {"job_id": "j", "rounds": 2}
    plan = Plan.model_validate(
        {
            "global_batch": 8,
            "microbatches": 2,
            "stages": [{"start": 0, "end": 3, "devices": [{"device": "a"}]}],
        }
    )
    put_plan(store, "j", plan)
    assert read_plan(store, "j") == plan


def test_federation_starts_count_and_forget(store):
    assert [count_start(store, "f"), count_start(store, "f")] == [1, 2]
    store.put_blob(b"model", "fl-model", "f")
    forget_federation(store, "f")
    assert count_start(store, "f") == 1
    assert store.get_blob("fl-model", "f") is None
