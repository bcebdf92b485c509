"""A whole training job through its pure cores, on scripted events and one fake clock.

Submitted, its workers vetted, profiled, their link measured and the job planned
(`prepare.apply`, played by `test_prepare.Shell`); then assigned, rounds run, a
device lost and the job recovered on the survivors, finishing every round
(`driver.apply`, played by `test_driver.Script`), as `jobs.JobRun` chains them.
No socket, no Redis, no sleeping: each core is fed what the shell would feed it.
"""

from __future__ import annotations

from common.ids import DeviceId
from common.messages import EvalDone, LinksMeasured, Probe, ProfileReply, ProfileRequest, RunRound
from services.coordinator.core import Reply
from services.coordinator.job_state import Record, Send, StorePlan
from services.coordinator.prepare_state import ProfileFacts
from tests.coordinator import test_driver as training
from tests.coordinator import test_prepare as preparing

A, B, C, D = training.A, training.B, training.C, training.D


def test_submit_profile_links_plan_assign_rounds_loss_recovery_finish() -> None:
    # preparation: four vetted workers, one profile asked of the profiler, three links measured
    shell = preparing.Shell(
        *(preparing.beat(d) for d in (A, B, C, D)),
        services={"profiler-x": 0.0, "planner": 0.0},
    )
    job = training.job_of(total=6, checkpoint_every=0).model_copy(
        update={"min_workers": 4, "planner": "asteroid"}
    )
    shell.start(job)
    assert {d for d, _ in shell.sent(Probe)} == {A, B, C, D}
    shell.answer_challenges(A, B, C, D, at=0.1)
    ((profiler, asked),) = shell.sent(ProfileRequest)
    key = f"{preparing.model_key(job.model)}:{preparing.FP}"
    shell.profiles[key] = ProfileFacts((1, 2, 4, 8), 4 * preparing.GiB)
    shell.feed(
        Reply(profiler, ProfileReply(job_id="j1", fingerprint=asked.fingerprint, ok=True, key=key)),
        at=1.0,
    )
    measured = 0
    while shell.state.phase == "links":
        measure = shell.state.measuring
        assert measure is not None and measure.request is not None
        prober, nonce = measure.prober, measure.request.nonce
        answer = LinksMeasured(device=prober, nonce=nonce, rates={measure.target: 1e8})
        shell.feed(Reply(prober, answer), at=1.5 + measured)
        measured += 1
    assert measured == 6 and shell.state.phase == "planning"  # every pair, one at a time
    plan = training.PLAN
    shell.feed(Reply(DeviceId("planner"), preparing.PlanReply(job_id="j1", ok=True, plan=plan)))
    assert shell.state.phase == "ready" and shell.state.plan == plan
    assert [r.state for r in preparing.of(shell.out, Record)] == ["profiling", "planning"]
    assert preparing.of(shell.out, StorePlan) == [StorePlan(plan)]

    # training on the plan the preparation made: three rounds, then b goes silent
    s = training.running(job, plan)
    training.run_rounds(s, 3)
    s.beat(plan.devices)
    assert s.run.committed == 3
    s.silence([B])
    assert s.run.phase == "recovering"
    s.feed(training.NO_CAPACITIES, at=s.now + 0.25)
    s.feed(training.CheckpointFound(0))  # no replica of b's stage: back to the checkpoint
    s.assigned(at=s.now + 1.0)
    assert B not in s.run.plan.devices and s.run.recovery is None and s.run.committed == 0
    started = [
        c.msg.round for c in s.round_done() if isinstance(c, Send) and isinstance(c.msg, RunRound)
    ]
    assert started == [1, 1, 1]  # round 0 replayed and committed; round 1 on the survivors
    training.run_rounds(s, 5)
    assert s.run.phase == "eval" and s.run.committed == 6

    def evaluated(d: DeviceId) -> EvalDone:
        last = d in {a.device for a in s.run.plan.stages[-1].devices}
        return EvalDone(
            device=d,
            epoch=s.epoch,
            round=6,
            stage=s.run.plan.stage_of(d),
            samples=512,
            loss_sum=256.0 if last else 0.0,
            correct=128 if last else 0,
        )

    s.replies(evaluated)
    assert s.run.phase == "checkpoint"
    s.replies(s.saved)
    assert s.run.phase == "finished" and s.run.committed == 6
    assert s.run.summary.losses == (2.0,) * 6  # one loss per round: the replayed ones replaced
    (recovery,) = s.run.summary.recoveries
    assert (recovery["lost"], recovery["from_round"], recovery["replayed"]) == (["b"], 0, 3)
