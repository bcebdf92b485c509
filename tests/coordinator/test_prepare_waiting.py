"""The wait for workers: a job without `min_workers` fits its cluster, and the wait is visible.

Scripted events on a fake clock (the `Shell` of `test_prepare`): a job that
names no `min_workers` starts on the vetted devices present once they settle;
every change of the vetted devices is written into the job's hash
(`NoteWaiting`), cleared when the wait ends, and a wait that times out says
how many it had and which.
"""

from __future__ import annotations

from common.records.jobs import JobRecord, Waiting
from services.coordinator.job_state import Record
from services.coordinator.membership import Member
from services.coordinator.prepare_state import NoteWaiting
from tests.coordinator.test_prepare import (
    FAKE,
    LIMITS,
    A,
    B,
    C,
    Shell,
    beat,
    job_of,
    logged,
    of,
)

SETTLE = LIMITS.settle_s


def test_a_job_without_min_workers_starts_on_the_vetted_present_once_they_settle() -> None:
    shell = Shell(beat(A), beat(B), beat(C))
    shell.start(job_of(min_workers=None))
    cmds = shell.answer_challenges(A, B, C, at=0.1)
    assert shell.state.phase == "workers"  # all three vetted: now they must stay so
    assert of(cmds, NoteWaiting)[-1] == NoteWaiting((A, B, C), None)
    cmds = shell.beats(0.1 + SETTLE / 2)
    assert shell.state.phase == "workers" and not of(cmds, Record)
    cmds = shell.beats(0.1 + SETTLE)
    assert [(r.state, dict(r.fields)) for r in of(cmds, Record)] == [
        ("profiling", {"workers": [A, B, C]})
    ]
    assert of(cmds, NoteWaiting) == [NoteWaiting(None)]  # the wait is over: cleared
    assert sorted(shell.state.chosen) == [A, B, C]


def test_a_worker_joining_during_the_settle_is_waited_for() -> None:
    shell = Shell(beat(A))
    shell.start(job_of(min_workers=None))
    shell.answer_challenges(A, at=0.1)
    shell.members[B] = Member(B, 1.0, beat(B))
    shell.beats(1.0)  # b is challenged: its answer is awaited, whatever the settle says
    shell.beats(0.1 + SETTLE + 0.5)
    assert shell.state.phase == "workers"
    shell.answer_challenges(B, at=1.2)
    shell.beats(1.2 + SETTLE - 0.1)
    assert shell.state.phase == "workers"  # b's vetting restarted the settle
    shell.beats(1.2 + SETTLE)
    assert shell.state.phase == "profiling" and sorted(shell.state.chosen) == [A, B]
    vetted = [c.fields["vetted"] for c in logged(shell.out, "waiting for workers")]
    assert vetted == ["0", "1", "2"]


def test_a_device_that_fails_its_challenge_does_not_hold_the_settled_ones() -> None:
    shell = Shell(beat(A), beat(FAKE))
    shell.start(job_of(min_workers=None))
    shell.answer_challenges(A, at=0.1)
    shell.beats(LIMITS.probe_timeout_s + 0.2)  # the fake's challenge expires: left out
    shell.beats(LIMITS.probe_timeout_s + 0.2 + SETTLE)
    assert shell.state.phase == "profiling" and list(shell.state.chosen) == [A]


def test_without_min_workers_and_no_worker_the_wait_fails_at_the_join_timeout() -> None:
    shell = Shell(beat(FAKE))
    shell.start(job_of(min_workers=None))
    for t in range(5, 61, 5):
        shell.beats(float(t))
    assert shell.state.phase == "workers"
    cmds = shell.beats(60.5)
    assert shell.state.phase == "failed"
    assert shell.state.outcome == (
        "no worker joined and was vetted within 60 s "
        "(left out: {'fake': 'it did not answer a challenge within 2 s'})"
    )
    assert of(cmds, NoteWaiting) == [NoteWaiting(None)]


def test_each_change_of_the_vetted_is_noted_with_what_the_job_needs() -> None:
    shell = Shell(beat(A), beat(B), beat(C))
    shell.start(job_of(min_workers=4))
    shell.answer_challenges(A, at=0.1)
    shell.answer_challenges(B, C, at=0.2)
    shell.beats(5.0)  # no change: no new note
    notes = of(shell.out, NoteWaiting)
    assert notes == [
        NoteWaiting((), 4),
        NoteWaiting((A,), 4),
        NoteWaiting((A, B), 4),
        NoteWaiting((A, B, C), 4),
    ]
    shell.beats(60.5)
    assert shell.state.phase == "failed"
    assert shell.state.outcome == (
        "min_workers: 4 workers wanted, 3 joined and vetted within 60 s "
        "(['a', 'b', 'c']; left out: none)"
    )


def test_the_noted_wait_reads_as_one_line_while_the_job_is_submitted() -> None:
    wait = Waiting.of(["dev-0", "dev-1", "dev-2"], 4).model_dump()
    record = JobRecord.model_validate({"state": "submitted", "waiting": wait})
    assert record.note == "waiting for workers 3/4 (dev-0, dev-1, dev-2)"
    assert JobRecord.model_validate({"state": "running", "waiting": wait}).note == ""
    failed = {"state": "failed", "waiting": wait, "error": "min_workers: ..."}
    assert JobRecord.model_validate(failed).note == "min_workers: ..."
    many = Waiting.of([f"w{i}" for i in range(10)], None)
    assert many.line == "waiting for workers 10 (w0, w1, w2, w3, w4, w5, w6, w7, +2 more)"
