"""A serving job's requests: taken in turn, refused, run and answered; and its endings.

The half of `serve_core` that runs once the shards are loaded (and the endings
every phase shares). The queue itself is the coordinator's (people's requests
fill it, fair between requesters); the core sees it as `Waiting` snapshots and
decides against the caller's clock what waited too long (refused, dropped),
what the model cannot answer (refused, the job goes on) and when the next one
is taken (`TakeRequest`, one request on the devices at a time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from common.ids import DeviceId
from common.messages import Message
from common.serving_messages import (
    InferChunk,
    InferenceDone,
    InferenceProgress,
    InferReply,
    Refusal,
    RunInference,
)
from services.coordinator.core import Log
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.job_state import Record, Send
from services.coordinator.serve_recover import recovered
from services.coordinator.serve_state import (
    Answer,
    AppendMetrics,
    Command,
    Drop,
    InFlight,
    Out,
    Serve,
    TakeRequest,
    begin_step,
    refusal,
)

__all__ = [
    "answered",
    "end",
    "fail",
    "next_request",
    "on_cancel",
    "on_progress",
    "on_taken",
    "on_waiting",
    "step_failed",
]


def step_failed(serve: Serve, reason: str, out: list[Command]) -> Out:
    """A step's replies did not come: the request running is told why, and the job fails."""
    running = serve.running
    if running is not None:
        out = [*out, _refuse(serve, running.req, running.number, reason, "failed")]
    return fail(serve, reason, out)


def on_waiting(serve: Serve, queued: tuple[PendingRequest, ...], now: float) -> Out:
    """Refuse what waited past its `wait_s` (or everything, once the job ended); take the next."""
    if serve.ended:
        return replace(serve, waiting=()), _refuse_all(serve, queued)
    late = [r for r in queued if r.expired(now)]
    keep = tuple(r for r in queued if not r.expired(now))
    out: list[Command] = [Drop(tuple(late))] if late else []
    out += [_refuse(serve, req, 0, _late(serve, req, len(keep), now), "late") for req in late]
    serve, more = next_request(replace(serve, waiting=keep))
    return serve, [*out, *more]


def next_request(serve: Serve) -> Out:
    """Ask for the next request if the devices are idle and one waits."""
    if (
        serve.phase != "serving"
        or serve.running is not None
        or serve.taking
        or not serve.waiting
        or serve.cancel is not None
    ):
        return serve, []
    return replace(serve, taking=True), [TakeRequest()]


def on_taken(serve: Serve, req: PendingRequest | None, now: float) -> Out:
    """Run the request taken, or refuse it: too late, unanswerable, or the job ended."""
    serve = replace(serve, taking=False, waiting=_without(serve.waiting, req))
    if req is None:
        return serve, []
    if serve.ended:
        return serve, _refuse_all(serve, (req,), drop=False)
    if req.expired(now):
        why = _late(serve, req, len(serve.waiting), now)
        serve, more = next_request(serve)
        return serve, [_refuse(serve, req, 0, why, "late"), *more]
    why_not = None if serve.config is None else refusal(serve.config, req.msg)
    if why_not is not None:
        serve, more = next_request(serve)
        return serve, [_refuse(serve, req, 0, why_not, "invalid"), *more]
    return run_request(serve, req, now)


def run_request(
    serve: Serve, req: PendingRequest, now: float, resume: InFlight | None = None
) -> Out:
    """Send the request to every device of the plan; the first one answers it.

    `resume` is the request a device loss cut off: it runs again under its own
    number, its prompt followed by what was generated so far, for the tokens
    still to come (greedy decoding then answers as an undisturbed run would).
    A request that asked for the prompt's logits runs again from the start.
    """
    if serve.plan is None:
        return fail(serve, "serving core out of order: a request before the plan")
    n, started = serve.requests + 1, now
    done: tuple[int, ...] = ()
    if resume is not None:
        n, started = resume.number, resume.started
        done = () if req.msg.logits else resume.generated
        stops = getattr(req.msg, "stop", ())
        if len(done) >= req.msg.new_tokens > 0 or (done and done[-1] in stops):
            return _finish(serve, resume, list(done), [], 0.0, now, take_next=True)
    devices = [DeviceId(d) for d in serve.plan.devices]
    msg = RunInference(
        serve_id=serve.spec.serve_id,
        epoch=serve.epoch,
        round=n,
        ids=[*req.msg.ids, *done],
        new_tokens=req.msg.new_tokens - len(done),
        first_step=len(done),
        temperature=req.msg.temperature,
        top_p=req.msg.top_p,
        seed=req.msg.seed,
        stop=req.msg.stop,
    )
    streamed = resume.streamed if resume is not None else 0
    running = InFlight(req, n, started, generated=done, resumed=len(done), streamed=streamed)
    serve = replace(serve, requests=max(n, serve.requests), running=running)
    limit = serve.limits.request_timeout_s
    serve = begin_step(serve, InferenceDone, devices[:1], n, now, limit, watch=devices[1:])
    return serve, [Send(d, msg) for d in devices]


def answered(
    serve: Serve, replies: Mapping[DeviceId, Message], now: float, take_next: bool = True
) -> Out:
    """Record the request's metrics, then answer it (whoever has an answer sees them).

    `take_next` False leaves the next request queued (devices are joining).
    """
    running = serve.running
    if running is None or serve.plan is None:
        return fail(serve, "serving core out of order: an answer without a request")
    out = replies[DeviceId(serve.plan.devices[0])]
    if not isinstance(out, InferenceDone):  # the wait takes nothing else
        return fail(serve, f"request {running.number} was answered with {out.type}")
    tokens = [*running.generated[: running.resumed], *out.tokens]
    return _finish(serve, running, tokens, out.logits, out.compute_s, now, take_next)


def _finish(
    serve: Serve,
    running: InFlight,
    tokens: list[int],
    logits: list[float],
    compute_s: float,
    now: float,
    take_next: bool,
) -> Out:
    """Answer the request running with `tokens` (every run's), and record its metrics."""
    req, n = running.req, running.number
    latency = now - running.started
    reply = InferReply(
        serve_id=serve.spec.serve_id,
        request=n,
        ok=True,
        tokens=tokens,
        logits=logits if req.msg.logits else [],
        latency_s=latency,
        queued_s=running.started - req.arrived,
        # a stop token ends generation early and is left out (sampling.finish_reason)
        finish_reason="stop" if len(tokens) < req.msg.new_tokens else "length",
    )
    metrics = {
        "request": n,
        "latency_s": round(latency, 6),
        "compute_s": round(compute_s, 6),
        "queued_s": round(reply.queued_s, 6),
        "tokens_in": len(req.msg.ids),
        "tokens_out": len(tokens),
    }
    done = {k: v for k, v in metrics.items() if k in ("request", "tokens_in", "tokens_out")}
    # recorded before the answer leaves: a client holding its answer finds the recovery
    serve, recovery = recovered(replace(serve, running=None), now)
    commands: list[Command] = [
        AppendMetrics(f"metrics of request {n}", metrics),
        *recovery,
        Answer(req.peer, reply),
        Log("info", "request answered", {**done, "latency_s": round(latency, 4)}),
    ]
    if serve.cancel is not None:
        serve, more = end(serve, "cancelled", serve.cancel)
    elif take_next:
        serve, more = next_request(serve)
    else:
        more = []
    return serve, [*commands, *more]


def on_progress(serve: Serve, peer: DeviceId, msg: InferenceProgress) -> Out:
    """Keep the tokens the ring's first device reports; stream them if the request asked.

    Only the running request's report from the first device of the plan, within
    the tokens asked for, is taken; anything else is dropped naming its sender
    (a late report of an earlier epoch is dropped the same way).
    """
    running, plan = serve.running, serve.plan
    why = {"peer": peer, "request": msg.round, "epoch": msg.epoch}
    at = (msg.serve_id, msg.epoch, msg.round)
    if running is None or plan is None or at != (serve.spec.serve_id, serve.epoch, running.number):
        return serve, [Log("info", "dropped progress of a request not running", why)]
    if peer != plan.devices[0] or msg.device != peer:
        return serve, [Log("warning", "dropped progress from a device not first in the ring", why)]
    generated = (*running.generated, *msg.tokens)
    if len(generated) > running.req.msg.new_tokens:
        return serve, [Log("warning", "dropped progress beyond the tokens asked for", why)]
    fresh = generated[running.streamed :] if running.req.msg.stream else ()
    streamed = max(running.streamed, len(generated))
    serve = replace(serve, running=replace(running, generated=generated, streamed=streamed))
    if not fresh:
        return serve, []
    chunk = InferChunk(serve_id=serve.spec.serve_id, request=running.number, tokens=list(fresh))
    return serve, [Answer(running.req.peer, chunk)]


def _late(serve: Serve, req: PendingRequest, others: int, now: float) -> str:
    """Why `req`, past its `wait_s`, is not run: the job is busy, not gone."""
    return (
        f"waited {now - req.arrived:.0f} s for its turn (its wait_s); requests of "
        f"{others} others are served in turn: the serving job "
        f"{serve.spec.serve_id} is busy, not gone; try again later"
    )


def _refuse(serve: Serve, req: PendingRequest, request: int, error: str, why: Refusal) -> Answer:
    """Answer `req` with `error` instead of an output; `why` says so to programs."""
    reply = InferReply(
        serve_id=serve.spec.serve_id, request=request, ok=False, error=error, refusal=why
    )
    return Answer(req.peer, reply)


def _without(
    waiting: tuple[PendingRequest, ...], req: PendingRequest | None
) -> tuple[PendingRequest, ...]:
    return tuple(r for r in waiting if r is not req)


# --- endings ------------------------------------------------------------------------


def on_cancel(serve: Serve, reason: str) -> Out:
    """End now, or once the request running is answered (it is not cut off half-way)."""
    if serve.running is None:
        return end(serve, "cancelled", reason)
    why = {"reason": reason, "request": serve.running.number}
    return replace(serve, cancel=reason), [Log("info", "cancel waits for the request", why)]


def fail(serve: Serve, reason: str, out: Sequence[Command] = ()) -> Out:
    """The job fails for `reason` after the commands `out`."""
    serve, more = end(serve, "failed", reason)
    return serve, [*out, *more]


def end(serve: Serve, phase: Literal["failed", "cancelled"], reason: str) -> Out:
    """Record the end (a failure's error, a cancel's reason); refuse what waits."""
    field = "error" if phase == "failed" else "reason"
    serve = replace(
        serve,
        phase=phase,
        outcome=reason,
        wait=None,
        running=None,
        taking=False,
    )
    out: list[Command] = [Record(phase, {field: reason}), *_refuse_all(serve, serve.waiting)]
    return replace(serve, waiting=()), out


def _refuse_all(
    serve: Serve, requests: Sequence[PendingRequest], drop: bool = True
) -> list[Command]:
    """Answer every one of `requests` with why the job ended (removing them from the queue)."""
    if not requests:
        return []
    if serve.phase == "failed":
        why = f"serving job {serve.spec.serve_id} ended: {serve.outcome}"
    else:
        why = f"serving job {serve.spec.serve_id} ended: cancelled ({serve.outcome})"
    out: list[Command] = [Drop(tuple(requests))] if drop else []
    return [*out, *(_refuse(serve, r, 0, why, "ended") for r in requests)]
