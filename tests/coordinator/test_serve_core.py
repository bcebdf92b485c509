"""A serving job's core, driven by scripted events on a fake clock: no sockets, no Redis.

A small `Script` plays the shell: it keeps the devices' heartbeats as the
coordinator's pump would, holds the queue of requests the clients' handler
fills, and answers `TakeRequest` (in the queue's order) and `Drop` as the
shell does. Every other command is returned, so each step's commands are
asserted as the shell sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from common.galaxy.profile import BlockProfile
from common.ids import DeviceId
from common.messages import Heartbeat, Probe, WorkerError
from common.serving_messages import (
    BlocksProfiled,
    InferenceDone,
    InferReply,
    InferRequest,
    LoadShard,
    ProfileBlocks,
    RunInference,
    ServeSpec,
    ShardLoaded,
    TransformerShape,
)
from services.coordinator.core import Beats, Heard, Log, ProbeAnswer, Reply, SendProbe, Tick
from services.coordinator.galaxy.cost import device_memory_bytes
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned
from services.coordinator.membership import Members, heard, on_heartbeat
from services.coordinator.serve_core import apply, start
from services.coordinator.serve_state import (
    Answer,
    AppendMetrics,
    Broke,
    Command,
    Drop,
    Event,
    Limits,
    ReadShape,
    ShapeRead,
    Taken,
    TakeRequest,
    Waiting,
)

A, B, C = DeviceId("a"), DeviceId("b"), DeviceId("c")
ALL = [A, B, C]
EPOCH = 77
SEQ = 12
LIMITS = Limits(heartbeat_deadline_s=1.5, probe_timeout_s=2.0)
DECODER = TransformerShape(
    kind="decoder",
    layers=2,
    hidden=48,
    heads=6,
    ffn=96,
    vocab_size=300,
    max_positions=64,
    ln_eps=1e-5,
)
BUDGET = 256 << 20
T = TypeVar("T")


def spec_of(**fields: object) -> ServeSpec:
    base: dict[str, object] = {"serve_id": "gpt", "model": DECODER, "seq_len": SEQ}
    return ServeSpec.model_validate({**base, **fields})


def profile(d: DeviceId, seq_len: int = SEQ) -> BlockProfile:
    return BlockProfile(
        device=d,
        seq_len=seq_len,
        mha=((1, 0.001), (6, 0.006)),
        mlp=((1, 0.0001), (96, 0.01)),
        con=((1, 0.0001), (SEQ, 0.001)),
    )


def of(kind: type[T], commands: Iterable[object]) -> list[T]:
    return [c for c in commands if isinstance(c, kind)]


def records(commands: Iterable[Command]) -> list[str]:
    return [c.state for c in of(Record, commands)]


class Script:
    """The shell's part: the clock, the heartbeats, and the queue of requests."""

    def __init__(
        self, spec: ServeSpec, devices: Sequence[DeviceId] = ALL, budget: int = BUDGET
    ) -> None:
        self.now = 0.0
        self.budget = budget
        self.members: Members = {}
        self.queue: list[PendingRequest] = []
        self.silent: set[DeviceId] = set()
        """Devices whose heartbeats stopped: `tick` beats all the others."""
        for d in devices:
            self.members = on_heartbeat(self.members, self.heartbeat(d), self.now)
        self.serve, self.started = start(spec, LIMITS, EPOCH, self.members, devices, self.now)

    def heartbeat(self, d: DeviceId) -> Heartbeat:
        return Heartbeat(device=d, data_addr=f"tcp://{d}.lan:7001", memory_budget=self.budget)

    def feed(self, event: Event, at: float | None = None) -> list[Command]:
        """Apply `event`; carry out Drop and TakeRequest as the shell does, return the rest."""
        if at is not None:
            self.now = at
        self.serve, commands = apply(self.serve, event, self.now)
        out: list[Command] = []
        for c in commands:
            if isinstance(c, Heard):
                self.members = heard(self.members, c.device, c.at)
            if isinstance(c, Drop):
                self.queue = [r for r in self.queue if all(r is not g for g in c.requests)]
            out.append(c)
            if isinstance(c, TakeRequest):
                taken = self.queue.pop(0) if self.queue else None
                out += self.feed(Taken(taken))
        return out

    def beat(self, devices: Iterable[DeviceId], at: float | None = None) -> list[Command]:
        if at is not None:
            self.now = at
        for d in devices:
            self.members = on_heartbeat(self.members, self.heartbeat(d), self.now)
        return self.feed(Beats(self.members))

    def ask(self, peer: str, ids: list[int], at: float | None = None, **fields: object) -> None:
        """A request arrives in the queue (the clients' handler); the core sees it next pass."""
        if at is not None:
            self.now = at
        msg = InferRequest.model_validate({"serve_id": "gpt", "ids": ids, **fields})
        self.queue.append(PendingRequest(DeviceId(peer), msg, self.now))

    def tick(self, at: float | None = None) -> list[Command]:
        """One pass of the shell: heartbeats of all but the silent, the queue, the tick."""
        out = self.beat([d for d in self.members if d not in self.silent], at)
        return out + self.feed(Waiting(tuple(self.queue))) + self.feed(Tick())

    def profiled(
        self, devices: Iterable[DeviceId] = ALL, seq_len: int = SEQ, epoch: int = EPOCH
    ) -> list[Command]:
        out: list[Command] = []
        for d in devices:
            msg = BlocksProfiled(device=d, serve_id="gpt", epoch=epoch, profile=profile(d, seq_len))
            out += self.feed(Reply(d, msg))
        return out

    def loaded(self, devices: Iterable[DeviceId], epoch: int = EPOCH) -> list[Command]:
        out: list[Command] = []
        for d in devices:
            msg = ShardLoaded(device=d, serve_id="gpt", epoch=epoch, weight_bytes=1000, load_s=0.1)
            out += self.feed(Reply(d, msg))
        return out

    def done(
        self, d: DeviceId, n: int, tokens: list[int], at: float | None = None, epoch: int = EPOCH
    ) -> list[Command]:
        msg = InferenceDone(
            device=d,
            serve_id="gpt",
            epoch=epoch,
            round=n,
            tokens=tokens,
            logits=[0.5, 0.25],
            compute_s=0.125,
        )
        return self.feed(Reply(d, msg), at)

    def serving(self) -> list[DeviceId]:
        """Profile and load: the job serves; the plan's devices."""
        plan_cmds = self.profiled()
        load = of(LoadShard, (c.msg for c in of(Send, plan_cmds)))
        devices = [DeviceId(d) for d in load[0].plan.devices]
        self.loaded(devices)
        assert self.serve.phase == "serving"
        return devices


def answers(commands: Iterable[Command]) -> list[tuple[DeviceId, InferReply]]:
    return [(c.peer, c.reply) for c in of(Answer, commands)]


def test_a_serving_job_profiles_plans_loads_answers_in_order_and_ends_at_its_cancel():
    s = Script(spec_of(mode="galaxy"))
    started = s.started
    assert of(SetAssigned, started) == [SetAssigned(frozenset(ALL))]
    assert records(started) == ["profiling"]
    profiling = [(c.device, c.msg) for c in of(Send, started)]
    assert [d for d, _ in profiling] == ALL
    ask = profiling[0][1]
    assert isinstance(ask, ProfileBlocks) and ask.epoch == EPOCH and ask.seq_len == SEQ
    assert (ask.heads, ask.cols, ask.rows) == ([2, 3, 4, 6], [24, 48, 72, 96], [3, 6, 9, 12])
    assert s.serve.phase == "profiling"

    planned = s.profiled()
    assert records(planned) == ["planning"]
    loads = [(c.device, c.msg) for c in of(Send, planned)]
    plan = loads[0][1].plan  # type: ignore[union-attr]
    assert plan.mode == "galaxy" and sum(plan.heads) == DECODER.heads
    assert [d for d, _ in loads] == [DeviceId(d) for d in plan.devices]
    assert all(isinstance(m, LoadShard) and m.peers[A] == "tcp://a.lan:7001" for _, m in loads)
    assert s.serve.phase == "loading"

    running = s.loaded(ALL)
    assert records(running) == ["running"]
    assert of(Record, running)[0].fields["plan"]["devices"] == plan.devices
    assert s.serve.phase == "serving" and s.serve.running is None

    s.ask("alice", [5, 17, 3], at=1.0, new_tokens=2)
    s.ask("bob", [11, 4], at=1.5)
    first = s.tick(at=2.0)
    runs = [c.msg for c in of(Send, first)]
    assert len(runs) == 3 and all(isinstance(m, RunInference) and m.round == 1 for m in runs)
    assert runs[0].ids == [5, 17, 3] and runs[0].new_tokens == 2  # type: ignore[union-attr]
    assert s.tick(at=2.5) == []  # bob waits while alice's request runs

    head = DeviceId(plan.devices[0])
    out = s.done(head, 1, [9, 9], at=3.0)
    metrics = of(AppendMetrics, out)
    assert [m.entry for m in metrics] == [
        {
            "request": 1,
            "latency_s": 1.0,
            "compute_s": 0.125,
            "queued_s": 1.0,
            "tokens_in": 3,
            "tokens_out": 2,
        }
    ]
    peer, reply = answers(out)[0]
    assert peer == "alice" and reply.ok and reply.request == 1 and reply.tokens == [9, 9]
    assert (reply.latency_s, reply.queued_s, reply.logits) == (1.0, 1.0, [0.5, 0.25])
    assert out.index(metrics[0]) < out.index(of(Answer, out)[0])  # metrics before the answer
    second = [c.msg for c in of(Send, out)]  # bob's was taken at once
    assert all(isinstance(m, RunInference) and m.round == 2 for m in second)

    out = s.done(head, 2, [], at=3.5)
    assert [m.entry["request"] for m in of(AppendMetrics, out)] == [2]
    assert [(p, r.request, r.ok) for p, r in answers(out)] == [("bob", 2, True)]
    assert of(AppendMetrics, out)[0].entry["queued_s"] == 1.5

    ended = s.feed(Cancelled("cancelled by request"), at=4.0)
    assert of(Record, ended) == [Record("cancelled", {"reason": "cancelled by request"})]
    assert s.serve.phase == "cancelled" and s.serve.ended
    assert s.feed(Tick(), at=5.0) == []


def test_a_request_past_its_wait_s_is_refused_saying_so_while_another_runs():
    s = Script(spec_of(mode="local"))
    devices = s.serving()
    s.ask("greedy", [1, 2], at=10.0)
    s.tick()  # it runs
    s.ask("impatient", [1, 2], at=10.0, wait_s=0.5)
    s.ask("patient", [3], at=10.2)
    assert answers(s.tick(at=10.4)) == []
    out = s.tick(at=10.6)
    drops = of(Drop, out)
    assert len(drops) == 1 and [r.peer for r in drops[0].requests] == ["impatient"]
    (peer, reply), *rest = answers(out)
    assert rest == [] and peer == "impatient" and not reply.ok and reply.request == 0
    assert reply.refusal == "late"
    assert reply.error == (
        "waited 1 s for its turn (its wait_s); requests of 1 others are served in turn: "
        "the serving job gpt is busy, not gone; try again later"
    )
    assert [r.peer for r in s.queue] == ["patient"]
    out = s.done(devices[0], 1, [], at=11.0)
    assert [(p, r.ok) for p, r in answers(out)] == [("greedy", True)]
    assert [m.msg.round for m in of(Send, out)] == [2]  # type: ignore[union-attr]
    assert s.serve.phase == "serving"


def test_a_request_the_model_cannot_answer_is_refused_and_the_job_goes_on():
    s = Script(spec_of(mode="megatron"))
    devices = s.serving()
    s.ask("x", [1, 300])
    s.ask("y", list(range(60)), new_tokens=8)
    s.ask("z", [4, 5])
    out = s.tick(at=1.0)
    refused = answers(out)
    assert [(p, r.ok, r.request) for p, r in refused] == [("x", False, 0), ("y", False, 0)]
    assert refused[0][1].error == "token ids must be in [0, 300), got [300]"
    assert "60 tokens plus 8 to generate exceed the model's 64 positions" in refused[1][1].error
    runs = [c.msg for c in of(Send, out)]
    assert len(runs) == len(devices) and runs[0].ids == [4, 5]  # type: ignore[union-attr]
    assert runs[0].round == 1  # type: ignore[union-attr]  # refusals take no number
    assert [(p, r.ok) for p, r in answers(s.done(devices[0], 1, [7], at=2.0))] == [("z", True)]
    assert s.serve.phase == "serving" and records(out) == []


def tight_budget() -> int:
    """A budget three devices hold DECODER in, two do not."""
    config = DECODER.config()
    fixed = device_memory_bytes(config, SEQ, 0, 0, 0)
    whole = device_memory_bytes(config, SEQ, config.heads, config.ffn, SEQ)
    return fixed + int((whole - fixed) * 0.4)


def test_a_device_lost_during_a_request_fails_the_job_when_the_survivors_cannot_hold_it():
    s = Script(spec_of(mode="megatron"), budget=tight_budget())
    devices = s.serving()
    s.ask("alice", [1, 2, 3], at=1.0)
    s.tick()
    s.silent = {devices[0]}  # the device answering the request goes silent
    s.ask("bob", [4], at=1.2)
    s.ask("carol", [5], at=1.3)
    assert of(SendProbe, s.tick(at=2.0)) == []  # 1 s of silence: not yet a suspect
    probes = of(SendProbe, s.tick(at=3.0))
    assert [p.device for p in probes] == [devices[0]]
    assert s.serve.phase == "serving"
    assert s.tick(at=4.5) == []  # the probe may still be answered
    out = s.tick(at=5.5)  # unanswered for longer than probe_timeout_s
    assert s.serve.phase == "failed"
    fail = of(Record, out)
    assert len(fail) == 1 and fail[0].state == "failed"
    error = fail[0].fields["error"]
    assert f"workers ['{devices[0]}'] missed heartbeats" in error
    assert "did not answer a probe within 2 s" in error
    assert f"the survivors {devices[1:]} cannot hold the model: no split fits" in error
    replies = answers(out)
    assert [(p, r.request, r.ok) for p, r in replies] == [
        ("alice", 1, False),
        ("bob", 0, False),
        ("carol", 0, False),
    ]
    assert replies[0][1].error == error
    assert all(r.error == f"serving job gpt ended: {error}" for _, r in replies[1:])
    assert s.queue == []  # dropped from the queue, not left for the next job
    s.ask("dave", [6], at=5.5)  # queued before the shell saw the end: refused too
    late = answers(s.tick(at=6.0))
    assert [(p, r.error) for p, r in late] == [("dave", f"serving job gpt ended: {error}")]


def test_a_probe_answered_in_time_keeps_the_request_running():
    s = Script(spec_of(mode="megatron"))
    devices = s.serving()
    s.ask("alice", [1], at=1.0)
    s.tick()
    s.silent = {devices[0]}
    probe = of(SendProbe, s.tick(at=3.0))
    assert [p.device for p in probe] == devices[:1]
    out = s.feed(ProbeAnswer(devices[0], probe[0].nonce), at=3.5)
    assert of(Heard, out) == [Heard(devices[0], 3.5)]
    assert s.tick(at=4.5) == []  # heard 1 s ago: not a suspect any more
    assert s.serve.phase == "serving"
    assert [(p, r.ok) for p, r in answers(s.done(devices[0], 1, [], at=4.6))] == [("alice", True)]


def test_a_worker_error_fails_the_request_and_the_job():
    s = Script(spec_of(mode="megatron"))
    devices = s.serving()
    s.ask("alice", [1], at=1.0)
    s.tick()
    err = WorkerError(device=devices[0], epoch=EPOCH, round=1, error="RuntimeError: boom")
    out = s.feed(Reply(devices[0], err))
    reason = f"worker {devices[0]} failed in round 1: RuntimeError: boom"
    assert of(Record, out) == [Record("failed", {"error": reason})]
    assert [(p, r.request, r.error) for p, r in answers(out)] == [("alice", 1, reason)]


def test_a_cancel_during_profiling_ends_the_job_at_once_and_late_profiles_change_nothing():
    s = Script(spec_of(mode="galaxy"))
    s.ask("early", [1, 2])  # requests may queue as soon as the job is the running one
    s.profiled([A])
    out = s.feed(Cancelled("stop it"), at=1.0)
    assert of(Record, out) == [Record("cancelled", {"reason": "stop it"})]
    assert s.serve.phase == "cancelled"
    assert s.profiled([B, C]) == []
    refused = answers(s.tick(at=1.5))
    assert [(p, r.error) for p, r in refused] == [
        ("early", "serving job gpt ended: cancelled (stop it)")
    ]


def test_a_cancel_while_a_request_runs_waits_for_its_answer():
    s = Script(spec_of(mode="local"))
    devices = s.serving()
    s.ask("alice", [1], at=1.0)
    s.tick()
    s.ask("bob", [2], at=1.1)
    out = s.feed(Cancelled("enough"), at=1.2)
    assert records(out) == [] and s.serve.phase == "serving"
    assert of(Send, s.tick(at=1.3)) == []  # bob's is not started
    out = s.done(devices[0], 1, [3], at=1.5)
    assert [(p, r.ok) for p, r in answers(out)] == [
        ("alice", True),
        ("bob", False),
    ]
    assert records(out) == ["cancelled"]
    assert answers(out)[1][1].error == "serving job gpt ended: cancelled (enough)"


def test_devices_that_do_not_join_in_time_fail_the_job_naming_them():
    spec = spec_of(devices=["a", "b", "z"])
    s = Script(spec, devices=[A, B])
    assert records(s.started) == [] and s.serve.phase == "joining"
    assert s.tick(at=30.0) == []
    out = s.tick(at=60.5)
    assert of(Record, out) == [
        Record(
            "failed",
            {"error": "workers ['z'] did not join within 60 s (joined: ['a', 'b'])"},
        )
    ]


def test_a_late_joiner_starts_the_profiling():
    s = Script(spec_of(devices=["a", "b", "z"]), devices=[A, B])
    out = s.beat([DeviceId("z")], at=5.0)
    assert records(out) == ["profiling"]
    assert [c.device for c in of(Send, out)] == [A, B, DeviceId("z")]


def test_no_worker_fails_at_once():
    s = Script(spec_of(), devices=[])
    assert of(Record, s.started) == [
        Record("failed", {"error": "no worker is connected to serve on"})
    ]


def test_a_model_the_devices_cannot_hold_fails_before_profiling():
    huge = DECODER.model_copy(update={"layers": 64, "hidden": 2048, "heads": 16, "ffn": 8192})
    s = Script(spec_of(model=huge))
    assert records(s.started) == ["failed"]
    assert "no split fits: the model's layers need" in of(Record, s.started)[0].fields["error"]
    assert of(Send, s.started) == []


def test_a_wrong_profile_seq_len_fails_the_job():
    s = Script(spec_of(mode="galaxy"))
    out = s.profiled(seq_len=7)
    assert of(Record, out) == [Record("failed", {"error": "device a profiled seq_len 7, asked 12"})]


def test_a_checkpoint_is_read_for_its_shape_and_its_round_pinned():
    spec = ServeSpec(serve_id="gpt", source="checkpoint", job="trained", seq_len=SEQ)
    s = Script(spec)
    assert of(ReadShape, s.started) == [ReadShape("trained", None)]
    assert s.serve.phase == "reading"
    out = s.feed(ShapeRead(DECODER, 4))
    assert records(out) == ["profiling"] and s.serve.spec.round == 4
    load = of(LoadShard, (c.msg for c in of(Send, s.profiled())))
    assert load and all(m.spec.round == 4 for m in load)


def test_a_checkpoint_that_cannot_be_read_fails_the_job():
    spec = ServeSpec(serve_id="gpt", source="checkpoint", job="trained", seq_len=SEQ)
    s = Script(spec)
    out = s.feed(Broke("no committed checkpoint of job trained"))
    assert of(Record, out) == [
        Record("failed", {"error": "no committed checkpoint of job trained"})
    ]


def test_stale_replies_and_other_messages_change_nothing():
    s = Script(spec_of(mode="megatron"))
    s.serving()
    old = ShardLoaded(device=A, serve_id="gpt", epoch=EPOCH - 1, weight_bytes=1, load_s=0.1)
    out = s.feed(Reply(A, old))
    assert of(Log, out) and s.serve.phase == "serving"
    assert s.feed(Reply(A, Probe(nonce=3))) == [
        Log("debug", "ignored stale reply", {"peer": A, "type": "probe"})
    ]
