"""A request's progress: kept in flight, streamed to its requester, dropped from anyone else."""

from __future__ import annotations

from common.ids import DeviceId
from common.serving_messages import InferChunk, InferenceProgress, InferReply, RunInference
from services.coordinator.core import Log, Reply
from services.coordinator.job_state import Send
from services.coordinator.serve_state import Answer, Command
from tests.coordinator.test_serve_core import EPOCH, Script, of, spec_of


def progress(d: DeviceId, n: int, tokens: list[int], epoch: int = EPOCH) -> Reply:
    msg = InferenceProgress(device=d, serve_id="gpt", epoch=epoch, round=n, tokens=tokens)
    return Reply(d, msg)


def chunks(commands: list[Command]) -> list[tuple[DeviceId, InferChunk]]:
    return [(c.peer, c.reply) for c in of(Answer, commands) if isinstance(c.reply, InferChunk)]


def running(stream: bool, **fields: object) -> tuple[Script, list[DeviceId], RunInference]:
    s = Script(spec_of(mode="galaxy"))
    devices = s.serving()
    s.ask("alice", [5, 17, 3], at=1.0, new_tokens=4, stream=stream, **fields)
    runs = [c.msg for c in of(Send, s.tick(at=2.0))]
    assert isinstance(runs[0], RunInference)
    return s, devices, runs[0]


def test_sampling_options_reach_every_device() -> None:
    _, _, run = running(False, temperature=0.7, top_p=0.9, seed=42, stop=[7, 8])
    assert (run.temperature, run.top_p, run.seed, run.stop) == (0.7, 0.9, 42, [7, 8])
    assert run.first_step == 0


def test_progress_is_kept_and_streamed_in_order_then_the_reply_has_every_token() -> None:
    s, devices, _ = running(True)
    head = devices[0]
    out = s.feed(progress(head, 1, [9]))
    assert chunks(out) == [("alice", InferChunk(serve_id="gpt", request=1, tokens=[9]))]
    out = s.feed(progress(head, 1, [4, 6]))
    assert [c.tokens for _, c in chunks(out)] == [[4, 6]]
    assert s.serve.running is not None and s.serve.running.generated == (9, 4, 6)
    out = s.done(head, 1, [9, 4, 6], at=3.0)
    replies = [c.reply for c in of(Answer, out)]
    assert len(replies) == 1 and isinstance(replies[0], InferReply)
    assert replies[0].tokens == [9, 4, 6] and replies[0].finish_reason == "stop"


def test_without_stream_progress_is_kept_but_not_sent() -> None:
    s, devices, _ = running(False)
    assert s.feed(progress(devices[0], 1, [9, 4])) == []
    assert s.serve.running is not None and s.serve.running.generated == (9, 4)
    out = s.done(devices[0], 1, [9, 4, 1, 2], at=3.0)
    reply = of(Answer, out)[0].reply
    assert isinstance(reply, InferReply) and reply.finish_reason == "length"


def test_progress_from_elsewhere_is_dropped_naming_the_sender() -> None:
    s, devices, _ = running(True)
    head, other = devices[0], devices[1]
    for event in (
        progress(other, 1, [9]),  # not the ring's first device
        Reply(
            other, InferenceProgress(device=head, serve_id="gpt", epoch=EPOCH, round=1, tokens=[9])
        ),
        progress(head, 2, [9]),  # another request
        progress(head, 1, [9], epoch=EPOCH - 1),  # an earlier job's
        progress(head, 1, [1, 2, 3, 4, 5]),  # more than the 4 tokens asked for
    ):
        out = s.feed(event)
        assert not of(Answer, out)
        logs = of(Log, out)
        assert len(logs) == 1 and logs[0].fields["peer"] == event.device
    assert s.serve.running is not None and s.serve.running.generated == ()
    s.done(head, 1, [], at=3.0)
    out = s.feed(progress(head, 1, [9]))  # nothing runs now
    assert not of(Answer, out) and len(of(Log, out)) == 1


def test_a_request_re_run_after_a_loss_streams_on_without_sending_a_token_twice() -> None:
    for logits in (False, True):  # from the tokens so far, or (the prompt's logits asked) anew
        s = Script(spec_of(mode="megatron"))
        devices = s.serving()
        s.ask("alice", [1, 2, 3], at=1.0, new_tokens=4, logits=logits, stream=True, seed=5)
        s.tick(at=1.0)
        assert [c.tokens for _, c in chunks(s.feed(progress(devices[0], 1, [7, 8])))] == [[7, 8]]
        s.silent = {devices[2]}
        s.tick(at=3.0)
        s.tick(at=5.5)  # probed, then lost: the survivors load new shards
        assert s.serve.phase == "loading"
        out = s.loaded(devices[:2], epoch=EPOCH + 1)
        runs = [c.msg for c in of(Send, out) if isinstance(c.msg, RunInference)]
        done = [] if logits else [7, 8]
        assert runs and all(r.ids == [1, 2, 3, *done] and r.seed == 5 for r in runs)
        assert runs[0].first_step == len(done)  # a seeded draw goes on where it was
        head = devices[0]
        rerun = [9, 10] if not logits else [7, 8, 9]
        out = s.feed(progress(head, 1, rerun, epoch=EPOCH + 1))
        assert [c.tokens for _, c in chunks(out)] == [[9, 10] if not logits else [9]]
