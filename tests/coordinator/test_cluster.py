"""The cluster core on scripted events and a fake clock: membership and people's requests.

`cluster.apply` decides who is in the cluster and what becomes of a submit, a
cancel, a drain or an inference request; here it is fed events one at a time
and its commands are read, with no socket, Redis or model build.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from typing import TypeVar

from common.ids import DeviceId
from common.job import JobSpec
from common.messages import Heartbeat, JobReply
from common.serving_messages import InferReply, InferRequest, ServeSpec
from common.zoo import ModelSpec
from services.coordinator.checked import CheckedJob
from services.coordinator.cluster import apply
from services.coordinator.cluster_state import (
    CancelIn,
    CheckJob,
    CheckServe,
    ClusterLimits,
    ClusterState,
    Command,
    DeviceUnrecorded,
    DrainIn,
    Event,
    ForgetDevices,
    HeartbeatIn,
    HelloIn,
    InferIn,
    JobChecked,
    JobLookedUp,
    JobRefused,
    JobRegistered,
    Log,
    LookUpJob,
    ProbeAnswerIn,
    RegisterJob,
    RegisterServe,
    Reply,
    ServeChecked,
    ServeIn,
    SubmitIn,
    Sweep,
    WriteDevice,
    WriteState,
)
from services.coordinator.membership import Probing, Rules, Verdict

C = TypeVar("C")
PEER = DeviceId("alice")
LIMITS = ClusterLimits(Rules(write_every_s=1.0, expiry_s=10.0, max_unassigned=2), version="1.0")


def beat(device: str, progress: int = 0, version: str = "1.0") -> HeartbeatIn:
    hb = Heartbeat(device=DeviceId(device), data_addr="tcp://127.0.0.1:1", version=version)
    return HeartbeatIn(hb.model_copy(update={"progress": progress}))


def job(jid: str = "j1") -> CheckedJob:
    spec = JobSpec(job_id=jid, model=ModelSpec(name="mlp"), rounds=2)
    return CheckedJob(spec, rounds=2, train_size=100, eval_size=10, layers=4)


def run(
    state: ClusterState, events: Sequence[tuple[float, Event]]
) -> tuple[ClusterState, list[Command]]:
    """Feed `events` (at their times) in turn, checking no state handed in is changed."""
    out: list[Command] = []
    for now, event in events:
        before = copy.deepcopy(state)
        new, commands = apply(state, event, now)
        assert state == before, f"apply changed the state it was given on {event}"
        state = new
        out += commands
    return state, out


def of(commands: Sequence[Command], kind: type[C]) -> list[C]:
    return [c for c in commands if isinstance(c, kind)]


def replies(commands: Sequence[Command]) -> list[JobReply | InferReply]:
    return [c.msg for c in commands if isinstance(c, Reply)]  # type: ignore[misc]


def submitted(
    cluster: ClusterState, checked: CheckedJob, recorded: str | None = None
) -> tuple[ClusterState, list[Command]]:
    """Submit `checked`'s spec and answer the check with the state Redis holds for its id."""
    cluster, first = apply(cluster, SubmitIn(PEER, checked.spec, False), 0.0)
    assert first == [CheckJob(PEER, checked.spec, False)]
    return apply(cluster, JobChecked(PEER, checked, False, recorded, recorded), 0.0)


# --- membership ----------------------------------------------------------------


def test_a_new_device_is_written_at_once_then_at_most_once_a_second() -> None:
    state = ClusterState(limits=LIMITS)
    state, out = run(state, [(0.0, beat("a"))])
    assert of(out, WriteDevice) == [WriteDevice(beat("a").hb, LIMITS.record_ttl_s)]
    assert [c.event for c in of(out, Log)] == ["worker joined"]
    assert state.counts[Verdict.JOINED] == 1 and "a" in state.members
    state, out = run(state, [(0.3, beat("a", 1)), (0.9, beat("a", 2))])
    assert of(out, WriteDevice) == []  # under a second since the write
    assert state.counts[Verdict.LIMITED] == 2
    assert state.members[DeviceId("a")].info.progress == 2  # memory has the latest
    state, out = run(state, [(1.05, beat("a", 3))])
    assert [w.hb.progress for w in of(out, WriteDevice)] == [3]
    assert state.counts[Verdict.WRITE] == 1


def test_a_device_beyond_the_cap_is_dropped_and_only_the_first_drop_logged() -> None:
    state, _ = run(ClusterState(limits=LIMITS), [(0.0, beat("a")), (0.0, beat("b"))])
    state, out = run(state, [(0.1, beat("c"))])
    assert "c" not in state.members and of(out, WriteDevice) == []
    assert [(c.level, c.fields["peer"]) for c in of(out, Log)] == [("warning", "c")]
    state, out = run(state, [(0.2, beat("d")), (0.3, beat("e"))])
    assert out == [] and state.counts[Verdict.DROPPED] == 3
    assert set(state.members) == {"a", "b"}


def test_the_running_jobs_devices_are_never_capped() -> None:
    state, _ = run(ClusterState(limits=LIMITS), [(0.0, beat("a")), (0.0, beat("b"))])
    state = ClusterState(**{**vars(state), "running": "job", "assigned": frozenset({"c"})})
    state, out = run(state, [(0.1, beat("c"))])
    assert "c" in state.members and len(of(out, WriteDevice)) == 1


def test_another_release_is_warned_of_once() -> None:
    state, out = run(ClusterState(limits=LIMITS), [(0.0, beat("a", version="0.9"))])
    warned = [c for c in of(out, Log) if c.level == "warning"]
    assert [c.fields["worker_version"] for c in warned] == ["0.9"]
    _, out = run(state, [(1.5, beat("a", 1, version="0.9"))])
    assert [c for c in of(out, Log) if c.level == "warning"] == []


def test_expiry_forgets_silent_devices_but_never_the_running_jobs() -> None:
    state, _ = run(ClusterState(limits=LIMITS), [(0.0, beat("a")), (0.0, beat("b"))])
    state = ClusterState(**{**vars(state), "running": "job", "assigned": frozenset({"a"})})
    state, out = run(state, [(5.0, Sweep()), (10.5, Sweep())])
    assert of(out, ForgetDevices) == [ForgetDevices((DeviceId("b"),))]
    assert set(state.members) == {"a"} and state.counts["expired"] == 1
    assert "b" not in state.versions
    logged = [c for c in of(out, Log) if c.event == "heartbeat counts"]
    assert logged and logged[-1].fields["expired"] == 1 and logged[-1].fields["known"] == 1
    # the job ended: its device is no longer kept
    state = ClusterState(**{**vars(state), "running": None})
    state, out = run(state, [(20.0, Sweep())])
    assert of(out, ForgetDevices) == [ForgetDevices((DeviceId("a"),))] and state.members == {}


def test_a_sweep_looks_a_few_times_a_second_at_most_and_logs_counts_once() -> None:
    state, _ = run(ClusterState(limits=LIMITS), [(0.0, beat("a"))])
    state, out = run(state, [(0.0, Sweep())])
    assert [c.event for c in of(out, Log)] == ["heartbeat counts"]
    state, out = run(state, [(0.5, Sweep())])  # too soon, and nothing changed anyway
    assert out == [] and state.next_sweep == 1.0
    state, out = run(state, [(0.6, DeviceUnrecorded(DeviceId("a"))), (1.2, Sweep())])
    assert [c.fields["unrecorded"] for c in of(out, Log)] == [1]


def test_a_probe_answer_counts_only_for_the_open_probe() -> None:
    state, _ = run(ClusterState(limits=LIMITS), [(0.0, beat("a"))])
    state = ClusterState(**{**vars(state), "probes": {DeviceId("a"): Probing(7, 4.0, 4.0)}})
    stale, out = run(state, [(5.0, ProbeAnswerIn(DeviceId("a"), 6))])
    assert stale.probes == state.probes and out[0].event.startswith("ignored")  # type: ignore[union-attr]
    state, out = run(state, [(5.0, ProbeAnswerIn(DeviceId("a"), 7))])
    assert state.probes == {} and state.members[DeviceId("a")].last_seen == 5.0


def test_a_service_hello_is_remembered_and_logged_once() -> None:
    state, out = run(
        ClusterState(), [(1.0, HelloIn("planner", "p1")), (2.0, HelloIn("planner", "p1"))]
    )
    assert state.services == {"planner": 2.0} and len(of(out, Log)) == 1


# --- submissions ---------------------------------------------------------------


def test_submit_is_checked_registered_queued_and_answered_ok() -> None:
    checked = job()
    state, out = submitted(ClusterState(), checked)
    assert out == [RegisterJob(PEER, checked, forget_old=False)]
    assert not state.queue  # not before Redis took the record
    state, out = apply(state, JobRegistered(PEER, checked), 0.0)
    assert list(state.queue) == [checked]
    assert replies(out) == [JobReply(job_id="j1", ok=True)]


def test_a_refused_check_or_registration_is_answered_and_nothing_queued() -> None:
    state, out = apply(ClusterState(), JobRefused(PEER, "j1", "model: no such model"), 0.0)
    assert not state.queue
    assert replies(out) == [JobReply(job_id="j1", ok=False, error="model: no such model")]


def test_a_submit_of_an_active_or_queued_id_is_refused() -> None:
    _, out = submitted(ClusterState(), job(), "running")
    assert replies(out) == [
        JobReply(job_id="j1", ok=False, error="job_id: job j1 is already running")
    ]
    queued = ClusterState(queue=deque([job()]))
    _, out = submitted(queued, job())
    assert replies(out) == [
        JobReply(job_id="j1", ok=False, error="job_id: job j1 is already queued")
    ]
    assert of(out, RegisterJob) == []


def test_an_id_with_an_earlier_run_needs_replace() -> None:
    _, out = submitted(ClusterState(), job(), "finished")
    (reply,) = replies(out)
    assert not reply.ok and "exists (finished)" in reply.error and "--replace" in reply.error
    answer = JobChecked(PEER, job(), True, "finished", "finished")
    _, out = apply(ClusterState(), answer, 0.0)
    assert out == [RegisterJob(PEER, job(), forget_old=True)]


def test_a_serving_job_is_checked_registered_and_queued() -> None:
    spec = ServeSpec(serve_id="gpt", source="checkpoint", job="trained", seq_len=8)
    state, out = apply(ClusterState(), ServeIn(PEER, spec), 0.0)
    assert out == [CheckServe(PEER, spec)]
    state, out = apply(state, ServeChecked(PEER, spec, None), 0.0)
    assert out == [RegisterServe(PEER, spec)]
    state, out = apply(state, JobRegistered(PEER, spec), 0.0)
    assert list(state.queue) == [spec] and replies(out) == [JobReply(job_id="gpt", ok=True)]
    _, out = apply(state, ServeChecked(PEER, spec, None), 0.0)
    assert replies(out) == [
        JobReply(job_id="gpt", ok=False, error="serve_id: job gpt is already queued")
    ]


# --- cancels, drains, inference ------------------------------------------------


def test_a_cancel_of_a_queued_job_removes_it_and_writes_cancelled() -> None:
    state, _ = run(
        ClusterState(),
        [(0.0, JobRegistered(PEER, job("j1"))), (0.0, JobRegistered(PEER, job("j2")))],
    )
    state, out = apply(state, CancelIn(PEER, "j1", "no longer needed"), 0.0)
    assert [q.job_id for q in state.queue] == ["j2"]
    assert of(out, WriteState) == [WriteState("j1", "cancelled", {"reason": "no longer needed"})]
    assert replies(out) == [JobReply(job_id="j1", ok=True)] and state.cancelled == {}


def test_a_cancel_of_the_running_job_is_noted_for_the_run() -> None:
    state = ClusterState(running="j1")
    state, out = apply(state, CancelIn(PEER, "j1", "stop"), 0.0)
    assert state.cancelled == {"j1": "stop"} and of(out, WriteState) == []
    assert replies(out) == [JobReply(job_id="j1", ok=True)]
    # a federated job's cancel stops the piece under way too
    state, _ = apply(
        ClusterState(running="fed-piece-1", federated="fed"), CancelIn(PEER, "fed", "x"), 0.0
    )
    assert state.cancelled == {"fed": "x", "fed-piece-1": "x"}


def test_a_cancel_of_an_unknown_job_says_its_state() -> None:
    state, out = apply(ClusterState(), CancelIn(PEER, "old", "x"), 0.0)
    assert out == [LookUpJob(PEER, "old")]
    _, out = apply(state, JobLookedUp(PEER, "old", "finished"), 0.0)
    assert replies(out) == [
        JobReply(job_id="old", ok=False, error="job old is not queued or running (finished)")
    ]


def test_a_drain_outside_the_running_job_is_refused_naming_its_devices() -> None:
    state = ClusterState(running="j1", assigned=frozenset({DeviceId("b"), DeviceId("a")}))
    same, out = apply(state, DrainIn(PEER, DeviceId("z"), "maintenance"), 0.0)
    (reply,) = replies(out)
    assert isinstance(reply, JobReply) and not reply.ok and reply.job_id == "j1"
    assert reply.error == "device 'z' runs no part of a job here (job j1 runs on ['a', 'b'])"
    assert same.drains == {}
    state, out = apply(state, DrainIn(PEER, DeviceId("a"), "maintenance"), 0.0)
    assert state.drains == {"a": "maintenance"} and replies(out) == [JobReply(job_id="j1", ok=True)]
    _, out = apply(ClusterState(), DrainIn(PEER, DeviceId("a"), "x"), 0.0)
    assert replies(out) == [
        JobReply(job_id="", ok=False, error="device 'a' runs no part of a job here")
    ]


def test_an_infer_for_a_serving_job_not_running_is_refused() -> None:
    msg = InferRequest(serve_id="gpt", ids=[1, 2], new_tokens=4)
    state, out = apply(ClusterState(running="other"), InferIn(PEER, msg), 0.0)
    (reply,) = replies(out)
    assert isinstance(reply, InferReply) and not reply.ok
    assert reply.error == "no serving job gpt is running here (running: other)"
    assert reply.refusal == "no_job"
    assert len(state.infer_queue) == 0


def test_infer_requests_wait_in_the_fair_queue_up_to_its_bound() -> None:
    msg = InferRequest(serve_id="gpt", ids=[1, 2], new_tokens=4)
    state = ClusterState(running="gpt")
    for i in range(16):
        state, out = apply(state, InferIn(PEER, msg), float(i))
        assert out == []
    assert len(state.infer_queue) == 16
    state, out = apply(state, InferIn(PEER, msg), 20.0)
    (reply,) = replies(out)
    assert not reply.ok and "16 requests of alice already wait" in reply.error
    assert reply.refusal == "busy"
    assert len(state.infer_queue) == 16
    taken = state.infer_queue.take()
    assert taken is not None and taken.arrived == 0.0
