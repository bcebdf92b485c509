"""A federated home's core, driven by scripted events on a fake clock: no sockets, no Redis.

Each test plays the shell: it feeds the federation's answers, the pieces' ends,
cancels and ticks at chosen times, and asserts the commands the shell would
carry out (what goes to the federation, which piece starts, what is recorded).
"""

from __future__ import annotations

from typing import TypeVar

import pytest

from common.errors import AsteroidError
from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.job import FederatedSpec, JobSpec
from common.zoo import ModelSpec
from services.coordinator.core import Beats, Log, Tick
from services.coordinator.federated_core import (
    RESEND_S,
    Answer,
    Broke,
    CancelPiece,
    Command,
    DataRead,
    Event,
    Home,
    PieceBroke,
    PieceDone,
    ReadData,
    SendFederation,
    StartPiece,
    apply,
    start,
)
from services.coordinator.job_state import Cancelled, Record

FED, ADDR, HOME = "digits", "tcp://127.0.0.1:5560", 2
TIMEOUT_S = 60.0
T = TypeVar("T")


def job(timeout_s: float = TIMEOUT_S) -> JobSpec:
    return JobSpec(
        job_id="learn",
        model=ModelSpec(name="mlp"),
        rounds=3,
        federation=FederatedSpec(federation_id=FED, address=ADDR, home=HOME, timeout_s=timeout_s),
    )


class Script:
    """The shell's side: a fake clock, the home's state, the commands of each step."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.now = 100.0
        self.home, self.out = start(job(timeout_s), self.now)

    def feed(self, event: Event, at: float | None = None) -> list[Command]:
        if at is not None:
            assert at >= self.now
            self.now = at
        self.home, self.out = apply(self.home, event, self.now)
        return self.out

    def model(self, status: str, round_id: int = -1, **fields: object) -> list[Command]:
        msg = FederatedModel.model_validate(
            {"federation": FED, "home": HOME, "status": status, "round_id": round_id, **fields}
        )
        return self.feed(Answer(msg))

    def reply(self, ok: bool = True, **fields: object) -> list[Command]:
        msg = FederationReply.model_validate({"federation": FED, "home": HOME, "ok": ok, **fields})
        return self.feed(Answer(msg))


def only(commands: list[Command], kind: type[T]) -> list[T]:
    return [c for c in commands if isinstance(c, kind)]


def sent(commands: list[Command]) -> list[SendFederation]:
    return only(commands, SendFederation)


def joined(script: Script) -> None:
    """Read the data, join, and be asked for the first model."""
    out = script.feed(DataRead(num_samples=120, histogram=(30, 50, 40)))
    (join,) = sent(out)
    assert isinstance(join.msg, JoinFederation) and join.fresh and join.attach is None
    assert join.msg.num_samples == 120 and join.msg.histogram == [30, 50, 40]
    assert script.home.ask is not None and script.home.ask.msg == join.msg  # joining
    (fetch,) = sent(script.reply())
    assert isinstance(fetch.msg, FetchModel) and fetch.msg.federation == FED
    assert script.home.phase == "fetching"


def test_start_records_running_then_reads_the_data() -> None:
    script = Script()
    assert script.out == [Record("running", {"federation": FED, "home": str(HOME)}), ReadData()]
    assert script.home.lifecycle == "running" and script.home.phase == "reading"


def test_a_federated_piece_from_join_to_finish() -> None:
    script = Script()
    joined(script)
    fetched_at = script.now
    out = script.model("train", round_id=7, version=3)
    assert out == [StartPiece(0, 7)] and script.home.phase == "piece"
    assert script.feed(Tick(), at=fetched_at + 30.0) == []  # a piece takes as long as it takes
    (update,) = sent(script.feed(PieceDone(0, local_accuracy=0.75), at=fetched_at + 42.0))
    assert update.attach == 0 and update.fresh  # piece 0's model travels with it
    assert update.msg == HomeUpdate(
        federation=FED,
        home=HOME,
        round_id=7,
        num_samples=120,
        latency_s=42.0,  # from the fetch: the model's download counts
        local_accuracy=0.75,
    )
    out = script.reply(version=4)
    (logged,) = only(out, Log)
    assert logged.event == "home update sent" and logged.fields["version"] == 4
    (fetch,) = sent(out)
    assert isinstance(fetch.msg, FetchModel)
    out = script.model("done")
    assert out == [Record("finished", {"pieces": 1})]
    assert script.home.ended and script.home.lifecycle == "finished"
    assert script.feed(Tick(), at=script.now + 100) == []  # an ended home stays ended


def test_two_pieces_count_and_number_their_jobs() -> None:
    script = Script()
    joined(script)
    for number, round_id in enumerate((5, 6)):
        assert script.model("train", round_id=round_id) == [StartPiece(number, round_id)]
        script.feed(PieceDone(number, -1.0), at=script.now + 1)
        script.reply()
    assert script.model("done") == [Record("finished", {"pieces": 2})]


def test_fetch_answered_wait_then_train() -> None:
    script = Script()
    joined(script)
    assert script.model("wait", wait_s=2.5) == [] and script.home.phase == "waiting"
    assert script.home.due == script.now + 2.5
    assert script.feed(Tick(), at=script.now + 2.0) == []  # still waiting
    out = script.feed(Beats({}), at=script.now + 0.6)  # any news tells the time
    (fetch,) = sent(out)
    assert isinstance(fetch.msg, FetchModel) and fetch.fresh
    refetched = script.now
    assert script.model("train", round_id=9) == [StartPiece(0, 9)]
    (update,) = sent(script.feed(PieceDone(0, 0.5), at=refetched + 3.0))
    assert isinstance(update.msg, HomeUpdate) and update.msg.latency_s == 3.0


def test_a_zero_wait_still_waits_a_moment() -> None:
    script = Script()
    joined(script)
    script.model("wait", wait_s=0.0)
    assert script.feed(Tick()) == []
    assert sent(script.feed(Tick(), at=script.now + 0.05))


def test_a_silent_federation_is_asked_again_then_gives_up_naming_its_address() -> None:
    script = Script(timeout_s=12.0)
    t0 = script.now
    (join,) = sent(script.feed(DataRead(10, (10,))))
    assert script.feed(Tick(), at=t0 + RESEND_S) == []  # not yet past the resend time
    (again,) = sent(script.feed(Tick(), at=t0 + RESEND_S + 0.1))
    assert again == SendFederation(join.msg, None, fresh=False)  # queued answers stay
    assert script.feed(Tick(), at=t0 + 2 * RESEND_S) == []
    (third,) = sent(script.feed(Tick(), at=t0 + 2 * RESEND_S + 0.2))
    assert third.msg == join.msg and not third.fresh
    out = script.feed(Tick(), at=t0 + 12.0)
    error = f"the federation at {ADDR} did not answer the join_federation within 12 s"
    assert out == [Record("failed", {"error": error})]
    assert script.home.phase == "failed" and script.home.outcome == error


def test_each_request_has_its_own_timeout() -> None:
    script = Script(timeout_s=12.0)
    script.feed(DataRead(10, (10,)))
    script.feed(Tick(), at=script.now + 11.0)
    script.reply()  # joined just in time: the fetch gets 12 s of its own
    assert script.home.due == script.now + RESEND_S
    assert not only(script.feed(Tick(), at=script.now + 11.9), Record)
    (failed,) = only(script.feed(Tick(), at=script.now + 0.1), Record)
    assert failed.state == "failed" and "fetch_model" in failed.fields["error"]


def test_an_unanswered_update_is_resent_with_its_model() -> None:
    script = Script()
    joined(script)
    script.model("train", round_id=3)
    (update,) = sent(script.feed(PieceDone(0, 0.9), at=script.now + 1))
    (again,) = sent(script.feed(Tick(), at=script.now + RESEND_S + 0.1))
    assert again == SendFederation(update.msg, 0, fresh=False)


def test_a_cancel_during_a_piece_cancels_the_piece_and_then_the_job() -> None:
    script = Script()
    joined(script)
    script.model("train", round_id=4)
    assert script.feed(Cancelled("enough")) == [CancelPiece(0, "enough")]
    assert script.home.phase == "piece"  # the piece stops at its next round boundary
    assert script.feed(Cancelled("enough")) == []  # asked once
    out = script.feed(PieceBroke(0, "job learn.r0 cancelled", cancelled=True))
    assert out == [Record("cancelled", {"reason": "enough"})]
    assert script.home.lifecycle == "cancelled"


def test_a_piece_that_finishes_although_cancelled_sends_nothing() -> None:
    script = Script()
    joined(script)
    script.model("train", round_id=4)
    script.feed(Cancelled("enough"))
    assert script.feed(PieceDone(0, 0.8)) == [Record("cancelled", {"reason": "enough"})]


def test_a_cancel_while_waiting_ends_at_once() -> None:
    script = Script()
    joined(script)
    script.model("wait", wait_s=30)
    assert script.feed(Cancelled("enough")) == [Record("cancelled", {"reason": "enough"})]
    assert script.feed(Tick(), at=script.now + 31) == []


def test_a_stale_update_answer_is_logged_and_the_home_fetches_again() -> None:
    script = Script()
    joined(script)
    script.model("train", round_id=11)
    script.feed(PieceDone(0, 0.6), at=script.now + 1)
    out = script.reply(ok=False, stale=True, error="round 11 has closed")
    warning, info = only(out, Log)
    assert warning.level == "warning" and warning.fields == {"error": "round 11 has closed"}
    assert info.event == "home update sent"
    (fetch,) = sent(out)
    assert isinstance(fetch.msg, FetchModel) and script.home.phase == "fetching"
    assert script.model("train", round_id=12) == [StartPiece(1, 12)]


def test_a_refusal_fails_the_job_with_the_federations_reason() -> None:
    script = Script()
    script.feed(DataRead(10, (10,)))
    out = script.reply(ok=False, error="model differs from the federation's")
    error = "the federation refused the join_federation: model differs from the federation's"
    assert out == [Record("failed", {"error": error})]


def test_answers_of_another_kind_are_out_of_date() -> None:
    script = Script()
    joined(script)
    assert script.reply() == []  # a second answer to a resent join: fetching goes on
    assert script.home.phase == "fetching"


def test_answers_while_no_request_waits_change_nothing() -> None:
    script = Script()
    joined(script)
    script.model("train", round_id=1)
    out = script.model("train", round_id=1)  # a resent fetch's second answer, mid-piece
    assert not only(out, StartPiece) and script.home.phase == "piece"


def test_a_federation_done_before_any_piece_fails_the_home() -> None:
    script = Script()
    joined(script)
    (failed,) = script.model("done")
    assert failed == Record(
        "failed", {"error": f"the federation {FED} ended before this home trained"}
    )


def test_a_failed_piece_or_effect_fails_the_job() -> None:
    script = Script()
    joined(script)
    script.model("train", round_id=1)
    out = script.feed(PieceBroke(0, "device a lost"))
    assert out == [Record("failed", {"error": "device a lost"})]
    script = Script()
    assert script.feed(Broke("a federated job needs a finite data set")) == [
        Record("failed", {"error": "a federated job needs a finite data set"})
    ]


def test_the_end_of_a_piece_not_under_way_is_ignored() -> None:
    script = Script()
    joined(script)
    out = script.feed(PieceDone(3, 0.1))
    assert not only(out, SendFederation) and script.home.phase == "fetching"


def test_a_job_without_a_federation_section_is_no_home() -> None:
    plain = JobSpec(job_id="plain", model=ModelSpec(name="mlp"), rounds=1)
    with pytest.raises(ValueError, match="no federation section"):
        start(plain, 0.0)


def test_the_lifecycle_table_guards_every_record() -> None:
    home = Script().home
    ended = Home(**{**home.__dict__, "lifecycle": "finished"})
    with pytest.raises(AsteroidError, match="already finished"):
        apply(ended, Broke("late"), 1.0)
