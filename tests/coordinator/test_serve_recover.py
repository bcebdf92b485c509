"""A serving job that loses a device re-plans on the survivors; one that joins again is taken in.

Scripted events on a fake clock, through the same `Script` shell as the
serving core's own tests: no sockets, no Redis.
"""

from __future__ import annotations

from dataclasses import replace

from common.ids import DeviceId
from common.messages import WorkerError
from common.serving_messages import LoadShard, ProfileBlocks, RunInference, ShardLoaded
from services.coordinator.core import Log, Reply, SendProbe
from services.coordinator.job_state import Send, SetAssigned
from services.coordinator.serve_state import Answer, AppendMetrics
from tests.coordinator.test_serve_core import (
    EPOCH,
    Script,
    answers,
    of,
    records,
    spec_of,
)

D = DeviceId("d")


def sent(kind: type, commands: list) -> list[tuple[DeviceId, object]]:
    return [(c.device, c.msg) for c in of(Send, commands) if isinstance(c.msg, kind)]


def lose(s: Script, device: DeviceId, at: float = 2.0) -> list:
    """`device` goes silent from `at`: probed, then declared lost; the commands of the loss."""
    s.silent = {device}
    assert of(SendProbe, s.tick(at=at + 1.0))
    return s.tick(at=at + 3.5)


def running_request(s: Script, generated: tuple[int, ...] = ()) -> list[DeviceId]:
    """A job serving on every device, alice's request of 6 tokens running, `generated` so far."""
    devices = s.serving()
    s.ask("alice", [1, 2, 3], at=1.0, new_tokens=6, logits=False)
    assert sent(RunInference, s.tick(at=1.0))
    assert s.serve.running is not None
    s.serve = replace(s.serve, running=replace(s.serve.running, generated=generated))
    return devices


def test_a_device_lost_mid_generation_is_planned_around_and_the_request_finishes():
    s = Script(spec_of(mode="megatron"))
    devices = running_request(s, generated=(7, 8))
    lost, left = devices[2], devices[:2]
    s.ask("bob", [4], at=2.5)  # waits while the job recovers
    out = lose(s, lost)
    assert s.serve.phase == "loading" and s.serve.epoch == EPOCH + 1
    assert records(out) == ["recovering"]
    assert answers(out) == []  # nobody is refused
    loads = sent(LoadShard, out)
    assert [d for d, _ in loads] == left
    assert all(m.epoch == EPOCH + 1 and m.plan.devices == left for _, m in loads)
    assert of(SetAssigned, out) == [SetAssigned(frozenset(left))]
    assert any(isinstance(c, Log) and "re-planning" in c.event for c in out)

    # a late answer of the old epoch changes nothing
    assert answers(s.done(devices[0], 1, [9], at=6.0)) == []
    out = s.loaded(left, epoch=EPOCH + 1)
    assert records(out) == ["running"]
    runs = sent(RunInference, out)
    assert [d for d, _ in runs] == left
    again = runs[0][1]
    assert isinstance(again, RunInference)
    assert (again.epoch, again.round) == (EPOCH + 1, 1)
    assert (again.ids, again.new_tokens) == ([1, 2, 3, 7, 8], 4)

    out = s.done(left[0], 1, [9, 10, 11, 12], at=7.0, epoch=EPOCH + 1)
    [(peer, reply)] = answers(out)
    assert (peer, reply.request, reply.ok) == ("alice", 1, True)
    assert reply.tokens == [7, 8, 9, 10, 11, 12]
    assert reply.latency_s == 6.0  # from when it was first sent
    recovery = [c.entry for c in of(AppendMetrics, out) if "recovery_s" in c.entry]
    assert len(recovery) == 1
    # last heard at 1.0, declared lost at 5.5, answered at 7.0
    assert recovery[0]["lost"] == [lost]
    assert (recovery[0]["recovery_s"], recovery[0]["detect_s"]) == (6.0, 4.5)
    # recorded before the answer leaves: a client holding its answer finds the recovery
    recorded = next(
        i for i, c in enumerate(out) if isinstance(c, AppendMetrics) and "recovery_s" in c.entry
    )
    answered = next(i for i, c in enumerate(out) if isinstance(c, Answer))
    assert recorded < answered
    assert s.serve.recovery is None
    # bob's request, which waited meanwhile, runs next on the survivors
    nxt = sent(RunInference, out)
    assert [d for d, _ in nxt] == left and nxt[0][1].round == 2


def test_a_request_whose_tokens_were_all_generated_is_answered_without_running_again():
    s = Script(spec_of(mode="megatron"))
    devices = running_request(s, generated=(1, 2, 3, 4, 5, 6))
    lose(s, devices[1])
    out = s.loaded(s.serve.devices, epoch=EPOCH + 1)
    assert sent(RunInference, out) == []
    [(_, reply)] = answers(out)
    assert reply.ok and reply.tokens == [1, 2, 3, 4, 5, 6]


def test_a_request_for_the_prompts_logits_runs_again_from_its_start():
    s = Script(spec_of(mode="megatron"))
    devices = s.serving()
    s.ask("alice", [1, 2, 3], at=1.0, new_tokens=6, logits=True)
    s.tick(at=1.0)
    assert s.serve.running is not None
    s.serve = replace(s.serve, running=replace(s.serve.running, generated=(7,)))
    lose(s, devices[0])
    [(_, again)] = sent(RunInference, s.loaded(s.serve.devices, epoch=EPOCH + 1))[:1]
    assert isinstance(again, RunInference)
    assert (again.ids, again.new_tokens) == ([1, 2, 3], 6)


def test_a_request_that_waits_past_its_wait_during_the_recovery_is_refused():
    s = Script(spec_of(mode="megatron"))
    devices = running_request(s)
    lose(s, devices[2])
    s.ask("bob", [4], at=5.5, wait_s=1.0)
    assert answers(s.tick(at=6.0)) == []
    late = answers(s.tick(at=7.0))
    assert [(p, r.ok) for p, r in late] == [("bob", False)]
    assert "for its turn" in late[0][1].error


def test_a_lost_device_heard_from_again_is_taken_back_at_the_next_idle_moment():
    s = Script(spec_of(mode="galaxy"))
    devices = running_request(s)
    lost = devices[1]
    lose(s, lost)
    s.loaded(s.serve.devices, epoch=EPOCH + 1)
    s.silent = set()  # the device is back (a restarted worker under the same name)
    out = s.tick(at=6.0)
    assert sent(LoadShard, out) == []  # alice's request runs: joining waits for it
    out = s.done(s.serve.devices[0], 1, [1, 2, 3, 4, 5, 6], at=6.5, epoch=EPOCH + 1)
    assert answers(out) and records(out) == ["replanning"]
    loads = sent(LoadShard, out)  # profiled before: planned on its kept profile
    assert sorted(d for d, _ in loads) == sorted(devices)
    assert all(m.epoch == EPOCH + 2 for _, m in loads)
    assert s.serve.gone == {}
    out = s.loaded(s.serve.devices, epoch=EPOCH + 2)
    assert records(out) == ["running"] and s.serve.phase == "serving"
    assert s.serve.plan is not None and sorted(s.serve.plan.devices) == sorted(devices)


def test_a_new_worker_takes_a_lost_ones_place_once_profiled():
    s = Script(spec_of(mode="galaxy"))
    devices = s.serving()
    s.ask("alice", [1], at=1.0)
    s.tick(at=1.0)
    lose(s, devices[0])
    s.loaded(s.serve.devices, epoch=EPOCH + 1)
    s.done(s.serve.devices[0], 1, [], at=6.0, epoch=EPOCH + 1)
    out = s.beat([D], at=6.5)  # a worker the job never had
    out += s.tick(at=6.5)
    profile = sent(ProfileBlocks, out)
    assert [d for d, _ in profile] == [D]
    assert s.serve.phase == "profiling" and records(out) == ["replanning"]
    out = s.profiled([D], epoch=EPOCH + 2)
    assert profile[0][1].epoch == EPOCH + 2
    loads = sent(LoadShard, out)
    assert sorted(d for d, _ in loads) == sorted([*devices[1:], D])
    assert records(out) == []  # replanning: no second planning record


def test_a_worker_failing_its_load_after_a_loss_fails_the_job():
    s = Script(spec_of(mode="megatron"))
    devices = running_request(s)
    lose(s, devices[2])
    err = WorkerError(device=devices[0], epoch=EPOCH + 1, round=0, error="out of memory")
    out = s.feed(Reply(devices[0], err), at=6.0)
    assert records(out) == ["failed"]
    [(peer, reply)] = answers(out)
    assert peer == "alice" and "out of memory" in reply.error
    assert sent(ShardLoaded, out) == []


def test_a_joining_worker_that_fails_to_profile_is_left_out_and_the_job_goes_on():
    s = Script(spec_of(mode="galaxy"))
    devices = s.serving()
    s.ask("alice", [1], at=1.0)
    s.tick(at=1.0)
    lose(s, devices[0])
    s.loaded(s.serve.devices, epoch=EPOCH + 1)
    s.done(s.serve.devices[0], 1, [], at=6.0, epoch=EPOCH + 1)
    s.beat([D], at=6.5)
    s.tick(at=6.5)
    assert s.serve.phase == "profiling"
    err = WorkerError(device=D, epoch=EPOCH + 2, round=0, error="no memory to profile")
    out = s.feed(Reply(D, err), at=7.0)
    assert s.serve.phase == "loading" and D not in s.serve.devices
    loads = sent(LoadShard, out)
    assert sorted(d for d, _ in loads) == sorted(devices[1:])
    s.loaded(s.serve.devices, epoch=EPOCH + 3)
    assert s.serve.phase == "serving"
    assert sent(ProfileBlocks, s.tick(at=8.0)) == []  # not asked again
    assert s.serve.recovery is None  # a refused join is not a loss to time
    s.beat([DeviceId("e")], at=8.5)  # another worker takes the lost one's place
    assert [d for d, _ in sent(ProfileBlocks, s.tick(at=8.5))] == ["e"]
    s.profiled([DeviceId("e")], epoch=EPOCH + 4)
    s.loaded(s.serve.devices, epoch=EPOCH + 4)
    s.beat([DeviceId("f")], at=9.0)  # the job is back to its size: no more joins
    assert sent(ProfileBlocks, s.tick(at=9.0)) == []


def test_a_device_the_membership_forgets_is_planned_around_like_a_lost_one():
    s = Script(spec_of(mode="megatron"))
    devices = s.serving()
    del s.members[devices[1]]  # expired from the coordinator's membership
    out = s.tick(at=1.0)
    assert s.serve.phase == "loading" and s.serve.epoch == EPOCH + 1
    assert records(out) == ["recovering"]
    assert sorted(d for d, _ in sent(LoadShard, out)) == sorted([devices[0], devices[2]])
