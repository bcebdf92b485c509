"""A job's preparation core on scripted events and a fake clock, without sockets or Redis.

Vetting, profiling, link measurement and planning are waiting states of
`prepare.apply`; the `Shell` below plays the coordinator's part: it feeds
events at given times and answers the commands that read something
(ReadProfiles, ReadClusterBase, MeasureLink) as `jobs.JobRun` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from common.ids import DeviceId
from common.job import JobSpec, ModelSpec
from common.messages import (
    Heartbeat,
    LinksMeasured,
    Message,
    PlanReply,
    PlanRequest,
    Probe,
    ProfileReply,
    ProfileRequest,
)
from common.model_key import model_key
from common.plan import Allocation, Plan, StageSpec
from common.profile import ClusterSpec, DeviceSpec
from services.coordinator import links, prepare
from services.coordinator.core import Beats, Log, ProbeAnswer, Reply, Tick
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned, StorePlan
from services.coordinator.membership import Member, Members
from services.coordinator.prepare_state import (
    ClusterBaseRead,
    Command,
    Event,
    ForgetLink,
    LinkAsked,
    MeasureLink,
    Prep,
    PrepLimits,
    ProfileFacts,
    ProfilesRead,
    ReadClusterBase,
    ReadProfiles,
    Services,
    StoreCluster,
    StoreLinks,
)

A, B, C, FAKE = DeviceId("a"), DeviceId("b"), DeviceId("c"), DeviceId("fake")
GiB = 1 << 30
FP = "x86_64-8c-4t-q2.5-3.0g-0123456789"
LIMITS = PrepLimits(
    join_timeout_s=60.0,
    probe_timeout_s=2.0,
    profile_timeout_s=10.0,
    plan_timeout_s=30.0,
    heartbeat_s=0.5,
    heartbeat_misses=6,
    link_probe_bytes=1 << 20,
    link_probe_timeout_s=3.0,
    link_bandwidth=1e9,
    endpoint="tcp://coord:5555",
)
LAYERS = 4


def beat(device: DeviceId, **fields: object) -> Heartbeat:
    base: dict[str, object] = {
        "device": device,
        "data_addr": f"tcp://{device}.lan:7000",
        "link_addr": f"tcp://{device}.lan:7001",
        "fingerprint": FP,
        "threads": 4,
        "cores": 8,
        "cpu_quota": 2.5,
        "memory_budget": 2 * GiB,
    }
    return Heartbeat.model_validate({**base, **fields})


def job_of(**fields: Any) -> JobSpec:
    defaults: dict[str, Any] = {"global_batch": 8, "min_workers": 2, "planner": "galaxy"}
    return JobSpec(job_id="j1", model=ModelSpec(name="mlp"), rounds=3, **{**defaults, **fields})


KEY = f"{model_key(ModelSpec(name='mlp'))}:{FP}"


def plan_on(*devices: DeviceId) -> Plan:
    return Plan(
        stages=[
            StageSpec(start=0, end=2, devices=[Allocation(device=devices[0])]),
            StageSpec(start=2, end=LAYERS, devices=[Allocation(device=d) for d in devices[1:]]),
        ],
        global_batch=8,
        microbatches=1,
        planner="galaxy",
        predicted_round_s=1.5,
    )


class Shell:
    """The coordinator's part: heartbeats, services, the profile cache and the cluster file."""

    def __init__(self, *beats: Heartbeat, services: Mapping[str, float] | None = None) -> None:
        self.now = 0.0
        self.members: Members = {hb.device: Member(hb.device, 0.0, hb) for hb in beats}
        self.services = dict(services or {})
        self.profiles: dict[str, ProfileFacts] = {}
        self.base: ClusterSpec | None = None
        self.link_nonce = 0
        self.out: list[Command] = []
        self.prep: Prep | None = None

    def start(self, job: JobSpec | None = None) -> list[Command]:
        prep, cmds = prepare.start(
            job or job_of(), LAYERS, LIMITS, self.now, self.members, self.services
        )
        return self._carry(prep, cmds)

    def feed(self, event: Event, at: float | None = None) -> list[Command]:
        if at is not None:
            self.now = at
        assert self.prep is not None
        prep, cmds = prepare.apply(self.prep, event, self.now)
        return self._carry(prep, cmds)

    def beats(self, at: float, *devices: DeviceId) -> list[Command]:
        """`devices` heartbeat at `at` (none: every member)."""
        for d in devices or list(self.members):
            self.members[d] = Member(d, at, self.members[d].info)
        return self.feed(Beats(dict(self.members)), at)

    def _carry(self, prep: Prep, cmds: list[Command]) -> list[Command]:
        """Keep what the core said; answer what reads something, as the shell does."""
        self.prep, done = prep, list(cmds)
        for cmd in cmds:
            self.out.append(cmd)
            answer: Event | None = None
            if isinstance(cmd, ReadProfiles):
                answer = ProfilesRead({k: self.profiles.get(k) for k in cmd.keys})
            elif isinstance(cmd, ReadClusterBase):
                answer = ClusterBaseRead(self.base)
            elif isinstance(cmd, MeasureLink):
                self.link_nonce += 1
                req = links.request(self.link_nonce, cmd.target, cmd.addr, 1 << 20, 3.0)
                answer = LinkAsked(cmd.prober, req)
            if answer is not None:
                done += self.feed(answer)
        return done

    def sent(self, kind: type[Message]) -> list[tuple[DeviceId, Any]]:
        return [
            (c.device, c.msg) for c in self.out if isinstance(c, Send) and isinstance(c.msg, kind)
        ]

    def answer_challenges(self, *devices: DeviceId, at: float) -> list[Command]:
        out: list[Command] = []
        for d, probe in self.sent(Probe):
            if d in devices:
                out += self.feed(ProbeAnswer(d, probe.nonce), at)
        return out

    @property
    def state(self) -> Prep:
        assert self.prep is not None
        return self.prep


def of(cmds: list[Command], kind: type[Any]) -> list[Any]:
    return [c for c in cmds if isinstance(c, kind)]


def logged(cmds: list[Command], event: str) -> list[Log]:
    return [c for c in cmds if isinstance(c, Log) and c.event == event]


def last_request(shell: Shell, kind: type[Message]) -> Any:
    return shell.sent(kind)[-1][1]


def test_submit_workers_vetting_profiling_links_plan_ready() -> None:
    shell = Shell(beat(A), beat(B), services={"profiler-x": 0.0})
    cmds = shell.start()
    probes = shell.sent(Probe)
    assert [d for d, _ in probes] == [A, B] and all(p.nonce < 0 for _, p in probes)
    assert logged(cmds, "waiting for workers")[0].fields["vetted"] == "0/2"
    assert shell.state.phase == "workers"

    cmds = shell.answer_challenges(A, B, at=0.1)
    assert [(r.state, dict(r.fields)) for r in of(cmds, Record)] == [
        ("profiling", {"workers": [A, B]})
    ]
    assert of(cmds, ReadProfiles) == [ReadProfiles((KEY,))]
    ((to, req),) = shell.sent(ProfileRequest)  # one kind of device: one request
    assert to == "profiler-x" and req.fingerprint == FP and req.batch_sizes == [1, 2, 4, 8]
    assert shell.state.phase == "profiling"

    reply = ProfileReply(job_id="j1", fingerprint=FP, ok=True, key=KEY)
    shell.profiles[KEY] = ProfileFacts((1, 2, 4, 8), 5 * GiB)
    cmds = shell.feed(Reply(DeviceId("profiler-x"), reply), at=4.0)
    assert of(cmds, ReadProfiles) == [ReadProfiles((KEY,))]  # the budgets it measured
    assert of(cmds, MeasureLink) == [MeasureLink(A, B, "tcp://b.lan:7001")]
    assert shell.state.phase == "links"

    measure = shell.state.measuring
    assert measure is not None and measure.request is not None
    answer = LinksMeasured(device=A, nonce=measure.request.nonce, rates={B: 1e8})
    cmds = shell.feed(Reply(A, answer), at=5.0)
    assert of(cmds, StoreLinks) == [StoreLinks((A, B), {"a|b": 1e8}, {})]
    (stored,) = of(cmds, StoreCluster)
    assert stored.cluster.links == {"a|b": 1e8} and [d.profile for d in stored.cluster.devices] == [
        KEY,
        KEY,
    ]
    assert [r.state for r in of(cmds, Record)] == ["planning"]
    assert not shell.sent(PlanRequest) and shell.state.phase == "planning"  # no planner yet

    shell.services["planner"] = 5.5
    shell.feed(Services(dict(shell.services)), at=5.5)
    ((to, asked),) = shell.sent(PlanRequest)
    assert to == "planner" and asked.cluster == stored.cluster and asked.profiles == [KEY]

    plan = plan_on(A, B)
    cmds = shell.feed(Reply(DeviceId("planner"), PlanReply(job_id="j1", ok=True, plan=plan)), at=7)
    assert cmds == [StorePlan(plan), SetAssigned(frozenset({A, B}))]
    assert shell.state.phase == "ready" and shell.state.plan == plan
    assert shell.feed(Tick(), at=8.0) == [] and shell.state.phase == "ready"  # ended: unchanged


def test_cached_profiles_are_not_asked_again() -> None:
    shell = Shell(beat(A), beat(B), services={"profiler-x": 0.0})
    shell.profiles[KEY] = ProfileFacts((1, 2, 4, 8, 16), 5 * GiB)
    shell.start()
    cmds = shell.answer_challenges(A, B, at=0.1)
    assert not shell.sent(ProfileRequest) and of(cmds, MeasureLink)
    assert of(cmds, ReadProfiles) == [ReadProfiles((KEY,))]  # once: the cache's read


def test_a_cancel_during_profiling_ends_the_preparation() -> None:
    shell = Shell(beat(A), beat(B), services={"profiler-x": 0.0})
    shell.start()
    shell.answer_challenges(A, B, at=0.1)
    assert shell.state.phase == "profiling"
    cmds = shell.feed(Cancelled("cancelled by op"), at=1.0)
    assert shell.state.phase == "cancelled" and shell.state.outcome == "cancelled by op"
    assert logged(cmds, "job cancel noted")
    reply = ProfileReply(job_id="j1", fingerprint=FP, ok=True, key=KEY)
    assert shell.feed(Reply(DeviceId("profiler-x"), reply), at=2.0) == []  # too late
    assert shell.state.phase == "cancelled"


def _planning(shell: Shell) -> None:
    shell.profiles[KEY] = ProfileFacts((1, 2, 4, 8), GiB)
    shell.start()
    shell.answer_challenges(A, B, at=0.1)
    measure = shell.state.measuring
    assert measure is not None and measure.request is not None
    shell.feed(Reply(A, LinksMeasured(device=A, nonce=measure.request.nonce, rates={B: 1e8})))
    assert shell.state.phase == "planning"


def test_a_planner_that_never_answers_fails_at_the_plan_timeout_naming_it() -> None:
    shell = Shell(beat(A), beat(B), services={"planner": 0.0})
    _planning(shell)
    assert len(shell.sent(PlanRequest)) == 1
    shell.feed(Tick(), at=0.1 + 29.0)
    assert shell.state.phase == "planning"
    shell.feed(Tick(), at=0.1 + 30.5)
    assert shell.state.phase == "failed" and not shell.state.config
    assert shell.state.outcome == "planner did not send the plan within 30 s"


def test_no_planner_joining_fails_at_the_plan_timeout_saying_how_to_start_one() -> None:
    shell = Shell(beat(A), beat(B))
    _planning(shell)
    shell.feed(Tick(), at=31.0)
    assert shell.state.outcome == (
        "no planner service joined within 30 s (start asteroid-planner with --coordinator "
        "tcp://coord:5555)"
    )
    assert not shell.sent(PlanRequest)


def test_a_planners_refusal_is_the_persons_to_fix() -> None:
    shell = Shell(beat(A), beat(B), services={"planner": 0.0})
    _planning(shell)
    refusal = PlanReply(job_id="j1", ok=False, error="nothing fits")
    shell.feed(Reply(DeviceId("planner"), refusal), at=1.0)
    assert shell.state.phase == "failed" and shell.state.config
    assert shell.state.outcome == "planner 'galaxy' failed: nothing fits"


def test_a_profiler_of_the_wrong_kind_then_the_next_one() -> None:
    shell = Shell(beat(A), beat(B), services={"profiler-1": 0.0, "profiler-2": 0.0})
    shell.start()
    shell.answer_challenges(A, B, at=0.1)
    assert [to for to, _ in shell.sent(ProfileRequest)] == ["profiler-1"]
    other = ProfileReply(job_id="j1", fingerprint=FP, ok=False, mine=False, error="not mine")
    shell.feed(Reply(DeviceId("profiler-1"), other), at=1.0)
    assert [to for to, _ in shell.sent(ProfileRequest)] == ["profiler-1", "profiler-2"]
    shell.feed(Reply(DeviceId("profiler-1"), other), at=1.1)  # a repeat: nobody waits for it
    assert shell.state.phase == "profiling"
    ok = ProfileReply(job_id="j1", fingerprint=FP, ok=True, key="m:other")
    shell.feed(Reply(DeviceId("profiler-2"), ok), at=2.0)
    assert shell.state.phase == "links" and set(shell.state.keys.values()) == {"m:other"}


def test_a_profiler_not_answering_in_time_is_passed_over_and_named_if_none_answers() -> None:
    shell = Shell(beat(A), beat(B), services={"profiler-1": 0.0, "profiler-2": 0.0})
    shell.start()
    shell.answer_challenges(A, B, at=0.1)
    shell.feed(Tick(), at=10.2)
    assert [to for to, _ in shell.sent(ProfileRequest)] == ["profiler-1", "profiler-2"]
    other = ProfileReply(job_id="j1", fingerprint=FP, ok=False, mine=False)
    shell.feed(Reply(DeviceId("profiler-2"), other), at=11.0)
    assert shell.state.phase == "failed" and not shell.state.config
    assert shell.state.outcome == f"profiler-1 did not send the profile of {FP} within 10 s"


def test_no_profiler_at_all_fails_naming_the_worker_once_the_wait_for_one_ends() -> None:
    shell = Shell(beat(A), beat(B))
    shell.start()
    shell.answer_challenges(A, B, at=0.1)
    shell.feed(Tick(), at=9.0)
    assert shell.state.phase == "profiling"
    shell.feed(Tick(), at=10.5)
    assert shell.state.outcome == (
        f"no profiler service runs on a device like worker a (fingerprint {FP}; asked none): "
        "start `asteroid-profiler --serve` on that device"
    )


def test_a_profiling_failure_on_the_right_kind_fails_naming_the_worker() -> None:
    shell = Shell(beat(A), beat(B), services={"profiler-1": 0.0})
    shell.start()
    shell.answer_challenges(A, B, at=0.1)
    bad = ProfileReply(job_id="j1", fingerprint=FP, ok=False, error="boom")
    shell.feed(Reply(DeviceId("profiler-1"), bad), at=1.0)
    assert shell.state.outcome == "profiling for worker a failed on profiler-1: boom"


def test_a_device_that_does_not_answer_the_challenge_is_left_out_with_the_reason() -> None:
    shell = Shell(beat(A), beat(B), beat(FAKE), services={"profiler-x": 0.0})
    shell.start()
    suspect = shell.feed(ProbeAnswer(A, 7), at=0.05)  # a suspect's answer: not a challenge's
    assert logged(suspect, "ignored a probe answer nobody waits for")
    shell.answer_challenges(A, B, at=0.1)
    assert shell.state.phase == "workers"  # the fake's challenge is still open
    cmds = shell.beats(2.5)
    (left,) = logged(cmds, "device left out of the plan")
    assert left.fields == {"device": FAKE, "reason": "it did not answer a challenge within 2 s"}
    assert shell.state.phase == "profiling" and sorted(shell.state.chosen) == [A, B]
    assert len(shell.sent(Probe)) == 3  # enough workers: the fake is not challenged again


def test_a_device_whose_claims_lie_is_not_even_challenged() -> None:
    shell = Shell(beat(A), beat(DeviceId("big"), threads=1024))
    cmds = shell.start(job_of(min_workers=1))
    assert [d for d, _ in shell.sent(Probe)] == [A]
    (left,) = logged(cmds, "device left out of the plan")
    assert "threads 1024" in str(left.fields["reason"])


def test_min_workers_not_reached_fails_at_the_join_timeout_naming_who_is_there() -> None:
    shell = Shell(beat(A), beat(FAKE))
    shell.start()
    shell.answer_challenges(A, at=0.1)
    cmds = shell.beats(2.5)
    assert logged(cmds, "device left out of the plan")
    assert [d for d, _ in shell.sent(Probe)] == [A, FAKE, FAKE]  # still short: asked again
    for t in range(5, 61, 5):
        shell.beats(float(t))
    assert shell.state.phase == "workers"
    shell.beats(60.5)
    assert shell.state.phase == "failed" and not shell.state.config
    assert shell.state.outcome == (
        "min_workers: 2 workers wanted, 1 joined and vetted within 60 s (['a']; left out: "
        "{'fake': 'it did not answer a challenge within 2 s'})"
    )


def test_workers_joining_late_are_counted_live() -> None:
    shell = Shell(beat(A))
    cmds = shell.start()
    shell.answer_challenges(A, at=0.1)
    shell.members[B] = Member(B, 1.0, beat(B))
    cmds = shell.beats(1.0)
    assert [d for d, _ in shell.sent(Probe)] == [A, B]
    cmds = shell.answer_challenges(B, at=1.1)
    assert [r.state for r in of(cmds, Record)] == ["profiling"]
    vetted = [c.fields["vetted"] for c in logged(shell.out, "waiting for workers")]
    assert vetted == ["0/2", "1/2", "2/2"]


def test_a_pair_that_times_out_or_has_no_sink_falls_back_and_never_fails_the_job() -> None:
    shell = Shell(beat(A), beat(B), beat(C, link_addr=""), services={"planner": 0.0})
    shell.profiles[KEY] = ProfileFacts((1, 2, 4, 8), GiB)
    shell.start(job_of(min_workers=3))
    shell.answer_challenges(A, B, C, at=0.1)
    assert of(shell.out, MeasureLink) == [MeasureLink(A, B, "tcp://b.lan:7001")]
    measure = shell.state.measuring
    assert measure is not None and measure.request is not None
    cmds = shell.feed(Tick(), at=0.1 + 3.0 + links.REPLY_SLACK_S + 0.1)
    assert of(cmds, ForgetLink) == [ForgetLink(A, measure.request.nonce)]
    (matrix,) = of(cmds, StoreLinks)
    assert matrix.links == {}
    assert matrix.errors == {
        "a|b": "a did not send the measurement of its link to b within 5 s",
        "a|c": "worker c advertises no bandwidth sink",
        "b|c": "worker c advertises no bandwidth sink",
    }
    assert logged(cmds, "links not measured: the planner assumes the fallback bandwidth for them")
    assert shell.state.phase == "planning"  # the job goes on, on the fallback bandwidth
    late = LinksMeasured(device=A, nonce=measure.request.nonce, rates={B: 1e8})
    assert not of(shell.feed(Reply(A, late)), StoreLinks)


def test_links_the_cluster_file_gives_are_not_measured() -> None:
    shell = Shell(beat(A), beat(B), services={"planner": 0.0})
    shell.profiles[KEY] = ProfileFacts((1, 2, 4, 8), GiB)
    shell.base = ClusterSpec(
        devices=[DeviceSpec(name="x", memory_bytes=GiB, profile="p")],
        bandwidth=5e8,
        links={"a|b": 2e8},
    )
    shell.start()
    cmds = shell.answer_challenges(A, B, at=0.1)
    assert not of(cmds, MeasureLink) and not of(cmds, StoreLinks)
    (stored,) = of(cmds, StoreCluster)
    assert stored.cluster.links == {"a|b": 2e8} and stored.cluster.bandwidth == 5e8


def test_a_replan_vets_only_the_unproven_and_asks_for_the_current_plans_round() -> None:
    shell = Shell(beat(A), beat(B), beat(C), services={"planner": 0.0})
    shell.profiles[KEY] = ProfileFacts((1, 2, 4, 8), GiB)
    current = plan_on(A, B)
    devices = {d: shell.members[d] for d in (A, B, C)}
    prep, cmds = prepare.replan(
        job_of(),
        LAYERS,
        LIMITS,
        devices,
        0.0,
        shell.members,
        shell.services,
        proven=frozenset({A, B}),
        next_challenge=-5,
        current=current,
        slowdowns={A: 2.0},
    )
    shell._carry(prep, cmds)
    assert shell.sent(Probe) == [(C, Probe(nonce=-5))]
    assert not of(shell.out, Record)
    shell.feed(Tick(), at=2.5)  # c never answers: planned without it
    assert sorted(shell.state.chosen) == [A, B] and shell.state.refused[C].startswith("it did")
    measure = shell.state.measuring
    assert measure is not None and measure.request is not None
    shell.feed(Reply(A, LinksMeasured(device=A, nonce=measure.request.nonce, rates={B: 1e8})))
    ((_, asked),) = shell.sent(PlanRequest)
    assert asked.current == current
    assert [d.slowdown for d in asked.cluster.devices] == [2.0, 1.0]
    better = plan_on(B, A)
    answer = PlanReply(job_id="j1", ok=True, plan=better, current_round_s=2.5)
    cmds = shell.feed(Reply(DeviceId("planner"), answer), at=3.0)
    assert cmds == [] and not of(shell.out, Record)  # no lifecycle step, no plan stored
    assert shell.state.phase == "ready" and shell.state.plan == better
    assert shell.state.current_s == 2.5


def test_a_given_plan_waits_for_its_devices_and_names_the_missing_at_the_join_timeout() -> None:
    shell = Shell(beat(A))
    plan = plan_on(A, B)
    prep, cmds = prepare.with_plan(job_of(), LAYERS, LIMITS, plan, 0.0, shell.members)
    shell._carry(prep, cmds)
    assert cmds == [StorePlan(plan), SetAssigned(frozenset({A, B}))]
    assert shell.state.phase == "devices"
    shell.beats(59.0)
    shell.beats(60.5)
    assert shell.state.phase == "failed"
    assert shell.state.outcome == "workers ['b'] did not join within 60 s (joined: ['a'])"


def test_a_given_plan_that_does_not_fit_the_model_is_refused_before_it_is_stored() -> None:
    wrong = plan_on(A, B).model_copy(
        update={"stages": [StageSpec(start=0, end=2, devices=[Allocation(device=A)])]}
    )
    prep, cmds = prepare.with_plan(job_of(), LAYERS, LIMITS, wrong, 0.0, {})
    assert prep.phase == "failed" and prep.config and cmds == []


@pytest.mark.parametrize("replan", [False, True])
def test_a_job_without_global_batch_cannot_be_planned(replan: bool) -> None:
    shell = Shell(beat(A), beat(B))
    job = job_of(global_batch=None, min_workers=1)
    if replan:
        prep, _ = prepare.replan(job, LAYERS, LIMITS, dict(shell.members), 0.0, {}, {})
    else:
        shell.start(job)
        shell.answer_challenges(A, B, at=0.1)
        prep = shell.state
    assert prep.phase == "failed" and prep.config
    assert prep.outcome == "global_batch: required when the planner makes the plan"
