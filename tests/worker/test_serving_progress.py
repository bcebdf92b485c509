"""A ring's first device reports generated tokens in order, batched in time, none lost."""

from __future__ import annotations

from common.ids import DeviceId
from common.serving_messages import InferenceProgress, RunInference
from services.worker.serving import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tokens_are_reported_in_order_batched_by_time_and_flushed_at_the_end() -> None:
    msg = RunInference(serve_id="s1", epoch=3, round=2, ids=[1], new_tokens=6)
    sent: list[InferenceProgress] = []
    clock = Clock()
    progress = Progress(msg, DeviceId("a"), sent.append, every_s=0.02, clock=clock)
    progress.token(10)  # the first token goes at once
    clock.now = 0.005
    progress.token(11)
    progress.token(12)  # within 20 ms of the last report: held
    clock.now = 0.03
    progress.token(13)  # 20 ms passed: 11, 12, 13 go together
    clock.now = 0.031
    progress.token(14)
    progress.flush()
    progress.flush()  # nothing left: no empty report
    assert [m.tokens for m in sent] == [[10], [11, 12, 13], [14]]
    assert {(m.serve_id, m.epoch, m.round, m.device) for m in sent} == {("s1", 3, 2, "a")}
