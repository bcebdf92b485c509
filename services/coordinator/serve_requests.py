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
from common.serving_messages import InferenceDone, InferReply, RunInference
from services.coordinator.core import Log
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.job_state import Record, Send
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
    "on_taken",
    "on_waiting",
    "step_failed",
]


def step_failed(serve: Serve, reason: str, out: list[Command]) -> Out:
    """A step's replies did not come: the request running is told why, and the job fails."""
    running = serve.running
    if running is not None:
        out = [*out, _refuse(serve, running.req, running.number, reason)]
    return fail(serve, reason, out)


def on_waiting(serve: Serve, queued: tuple[PendingRequest, ...], now: float) -> Out:
    """Refuse what waited past its `wait_s` (or everything, once the job ended); take the next."""
    if serve.ended:
        return replace(serve, waiting=()), _refuse_all(serve, queued)
    late = [r for r in queued if r.expired(now)]
    keep = tuple(r for r in queued if not r.expired(now))
    out: list[Command] = [Drop(tuple(late))] if late else []
    for req in late:
        why = (
            f"waited {now - req.arrived:.0f} s for its turn (its wait_s); requests of "
            f"{len(keep)} others are served in turn: the serving job "
            f"{serve.spec.serve_id} is busy, not gone; try again later"
        )
        out.append(_refuse(serve, req, 0, why))
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
        why = (
            f"waited {now - req.arrived:.0f} s for its turn (its wait_s); requests of "
            f"{len(serve.waiting)} others are served in turn: the serving job "
            f"{serve.spec.serve_id} is busy, not gone; try again later"
        )
        serve, more = next_request(serve)
        return serve, [_refuse(serve, req, 0, why), *more]
    why_not = None if serve.config is None else refusal(serve.config, req.msg)
    if why_not is not None:
        serve, more = next_request(serve)
        return serve, [_refuse(serve, req, 0, why_not), *more]
    return run_request(serve, req, now)


def run_request(serve: Serve, req: PendingRequest, now: float) -> Out:
    """Send the request to every device of the plan; the first one answers it."""
    if serve.plan is None:
        return fail(serve, "serving core out of order: a request before the plan")
    n = serve.requests + 1
    devices = [DeviceId(d) for d in serve.plan.devices]
    msg = RunInference(
        serve_id=serve.spec.serve_id,
        epoch=serve.epoch,
        round=n,
        ids=req.msg.ids,
        new_tokens=req.msg.new_tokens,
    )
    serve = replace(serve, requests=n, running=InFlight(req, n, now))
    serve = begin_step(serve, InferenceDone, devices[:1], n, now, serve.limits.request_timeout_s)
    return serve, [Send(d, msg) for d in devices]


def answered(serve: Serve, replies: Mapping[DeviceId, Message], now: float) -> Out:
    """Record the request's metrics, then answer it (whoever has an answer sees them)."""
    running = serve.running
    if running is None or serve.plan is None:
        return fail(serve, "serving core out of order: an answer without a request")
    out = replies[DeviceId(serve.plan.devices[0])]
    if not isinstance(out, InferenceDone):  # the wait takes nothing else
        return fail(serve, f"request {running.number} was answered with {out.type}")
    req, n = running.req, running.number
    latency = now - running.started
    reply = InferReply(
        serve_id=serve.spec.serve_id,
        request=n,
        ok=True,
        tokens=out.tokens,
        logits=out.logits if req.msg.logits else [],
        latency_s=latency,
        queued_s=running.started - req.arrived,
    )
    metrics = {
        "request": n,
        "latency_s": round(latency, 6),
        "compute_s": round(out.compute_s, 6),
        "queued_s": round(reply.queued_s, 6),
        "tokens_in": len(req.msg.ids),
        "tokens_out": len(out.tokens),
    }
    done = {k: v for k, v in metrics.items() if k in ("request", "tokens_in", "tokens_out")}
    commands: list[Command] = [
        AppendMetrics(f"metrics of request {n}", metrics),
        Answer(req.peer, reply),
        Log("info", "request answered", {**done, "latency_s": round(latency, 4)}),
    ]
    serve = replace(serve, running=None)
    if serve.cancel is not None:
        serve, more = end(serve, "cancelled", serve.cancel)
    else:
        serve, more = next_request(serve)
    return serve, [*commands, *more]


def _refuse(serve: Serve, req: PendingRequest, request: int, error: str) -> Answer:
    """Answer `req` with `error` instead of an output."""
    reply = InferReply(serve_id=serve.spec.serve_id, request=request, ok=False, error=error)
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
    return [*out, *(_refuse(serve, r, 0, why) for r in requests)]
