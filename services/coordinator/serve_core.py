"""A serving job's decisions as a pure function: `apply(serve, event, now) -> (serve, commands)`.

Galaxy's workflow (§III-A) as a state machine: the devices are heard from
(`joining`), a checkpoint's shape is read if one is served (`reading`), every
device times the Transformer blocks (`profiling`), the planner of the job's
mode splits heads, MLP columns and sequence rows under each device's memory
budget (pure, so it runs inside the step that takes the last profile), every
device loads its shard (`loading`), and then requests are run one at a time
(`serving`). Each step's replies are awaited with `core.Wait`, so a silent
device is probed and declared lost by the same rules as a training round's.

A request that waited past its `wait_s`, or one the model cannot answer, is
refused here, against the caller's clock `now`. The job ends when cancelled
(its normal end: a request running is answered first) or when a step fails;
the requests still queued are then refused with the reason. Nothing here
touches a socket, Redis or the clock: the shell (`serving.ServeRun`) carries
the commands out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pydantic import ValidationError

from common.errors import AsteroidError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from common.ids import DeviceId
from common.messages import Message
from common.serving_messages import (
    BlocksProfiled,
    InferenceProgress,
    LoadShard,
    ProfileBlocks,
    ServeSpec,
    ShardLoaded,
    TransformerShape,
)
from services.coordinator import core
from services.coordinator.core import (
    Beats,
    Complete,
    Fail,
    Heard,
    Log,
    Lost,
    ProbeAnswer,
    Reply,
    Tick,
)
from services.coordinator.galaxy.choose import DEFAULT_LINK_BPS, STEP_LATENCY_S, Link, choose
from services.coordinator.galaxy.planner import (
    plan_galaxy,
    plan_local,
    plan_megatron,
    plan_sp,
    require_capacity,
)
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned
from services.coordinator.membership import Members, heard
from services.coordinator.serve_recover import (
    budgets,
    idle,
    joiners,
    left_job,
    lost,
    shortfall,
    survivors,
)
from services.coordinator.serve_requests import (
    answered,
    fail,
    next_request,
    on_cancel,
    on_progress,
    on_taken,
    on_waiting,
    run_request,
    step_failed,
)
from services.coordinator.serve_state import (
    Broke,
    Command,
    Event,
    Limits,
    Out,
    ReadShape,
    Serve,
    ShapeRead,
    Taken,
    Waiting,
    begin_step,
    profile_sizes,
)

__all__ = ["apply", "start"]


def start(
    spec: ServeSpec,
    limits: Limits,
    epoch: int,
    members: Members,
    alive: Sequence[DeviceId],
    now: float,
) -> Out:
    """A serving job from `now` on the spec's devices (none named: every `alive` worker)."""
    devices = tuple(spec.devices) if spec.devices else tuple(sorted(alive))
    serve = Serve(
        spec, limits, epoch, devices, started=now, members=dict(members), size=len(devices)
    )
    if not devices:
        return fail(serve, "no worker is connected to serve on")
    return _joined_yet(serve, now, [SetAssigned(frozenset(devices))])


def apply(serve: Serve, event: Event, now: float) -> Out:
    """The job after `event` at time `now`, and what the shell must do about it."""
    if isinstance(event, Waiting):
        return on_waiting(serve, event.requests, now)
    if isinstance(event, Taken):
        return on_taken(serve, event.request, now)
    if serve.ended:
        return serve, []
    if isinstance(event, Cancelled):
        return on_cancel(serve, event.reason)
    if isinstance(event, Broke):
        return fail(serve, event.error)
    if isinstance(event, ShapeRead):
        if serve.phase != "reading":
            return serve, []
        spec = serve.spec.model_copy(update={"round": event.round})
        read = Log("info", "serving a checkpoint", {"trained_by": spec.job, "round": event.round})
        return _prepare(replace(serve, spec=spec), event.shape, now, [read])
    if isinstance(event, Reply) and isinstance(event.msg, InferenceProgress):
        return on_progress(serve, event.device, event.msg)  # not a reply the wait takes
    if isinstance(event, Beats) and (left := left_job(serve, event.members)):
        reason = f"workers {left} left: the coordinator no longer knows them"
        return _lost(replace(serve, members=dict(event.members), wait=None), left, reason, now, [])
    if serve.wait is not None:
        return _waited(serve, serve.wait, event, now)
    if isinstance(event, Beats):
        serve = replace(serve, members=dict(event.members))
    elif isinstance(event, ProbeAnswer):
        return _probe_answered(serve, event, now)
    elif isinstance(event, Reply):
        why = {"peer": event.device, "type": event.msg.type}
        return serve, [Log("debug", "ignored stale reply", why)]
    if serve.phase == "joining":
        return _joined_yet(serve, now, [])
    if isinstance(event, Tick) and idle(serve) and (back := joiners(serve, now)):
        return _rejoin(serve, back, now)
    return serve, []


# --- joining and preparing --------------------------------------------------------


def _joined_yet(serve: Serve, now: float, out: list[Command]) -> Out:
    """Go on once every device was heard from; fail once the join deadline passed."""
    missing = [d for d in serve.devices if d not in serve.members]
    if not missing:
        return _read_shape(serve, now, out)
    timeout = serve.limits.join_timeout_s
    if now > serve.started + timeout:
        joined = sorted(serve.members)
        why = f"workers {missing} did not join within {timeout:g} s (joined: {joined})"
        return fail(serve, why, out)
    return serve, out


def _read_shape(serve: Serve, now: float, out: list[Command]) -> Out:
    """The served shape: the spec's, or a checkpoint's (read by the shell)."""
    spec = serve.spec
    if spec.model is not None:
        return _prepare(serve, spec.model, now, out)
    if spec.job is None:  # the spec's validator makes this unreachable
        return fail(serve, f"serving job {spec.serve_id} names no model and no job", out)
    return replace(serve, phase="reading"), [*out, ReadShape(spec.job, spec.round)]


def _prepare(serve: Serve, shape: TransformerShape, now: float, out: list[Command]) -> Out:
    """Refuse a model the devices cannot hold; else have every device time the blocks."""
    spec, devices = serve.spec, list(serve.devices)
    try:
        config = shape.config()
        require_capacity(config, budgets(serve, devices), spec.seq_len)
    except (AsteroidError, ValidationError) as exc:
        return fail(serve, str(exc), out)
    msg = _profile_request(serve, shape)
    serve = replace(serve, phase="profiling", shape=shape, config=config)
    serve = begin_step(serve, BlocksProfiled, devices, 0, now, serve.limits.load_timeout_s)
    return serve, [*out, Record("profiling"), *(Send(d, msg) for d in devices)]


def _profiled(serve: Serve, replies: Mapping[DeviceId, Message], now: float) -> Out:
    """Plan on the profiles (a wrong seq_len fails the job), then have the shards loaded.

    Profiles kept from earlier (devices joining a running job are the only ones
    asked) are planned on with the new ones.
    """
    spec = serve.spec
    profiles: dict[str, BlockProfile] = dict(serve.profiles)
    for d, reply in replies.items():
        if not isinstance(reply, BlocksProfiled):  # the wait takes nothing else
            return fail(serve, f"device {d} answered profiling with {reply.type}")
        if reply.profile.seq_len != spec.seq_len:
            why = f"device {d} profiled seq_len {reply.profile.seq_len}, asked {spec.seq_len}"
            return fail(serve, why)
        profiles[d] = reply.profile
    serve = replace(serve, profiles=profiles)
    out: list[Command] = [] if serve.replanning else [Record("planning")]
    return _load(serve, now, out)


def _load(serve: Serve, now: float, out: list[Command]) -> Out:
    """Plan on the job's devices with the profiles kept, and have every shard loaded."""
    spec, config = serve.spec, serve.config
    if config is None or serve.shape is None:
        return fail(serve, "serving core out of order: profiled before the shape was known", out)
    try:
        plan = _plan(
            spec, config, list(serve.devices), dict(serve.profiles), budgets(serve, serve.devices)
        )
    except (AsteroidError, ValidationError) as exc:
        return fail(serve, str(exc), out)
    devices = [DeviceId(d) for d in plan.devices]
    if gone := [d for d in devices if d not in serve.members]:
        return fail(serve, f"workers {gone} of the plan are no longer known", out)
    peers = {d: serve.members[d].info.data_addr for d in devices}
    load = LoadShard(
        serve_id=spec.serve_id,
        epoch=serve.epoch,
        spec=spec,
        model=serve.shape,
        plan=plan,
        peers=peers,
    )
    serve = replace(serve, phase="loading", plan=plan)
    serve = begin_step(serve, ShardLoaded, devices, 0, now, serve.limits.load_timeout_s)
    return serve, [*out, SetAssigned(frozenset(devices)), *(Send(d, load) for d in devices)]


def _plan(
    spec: ServeSpec,
    config: TransformerConfig,
    devices: list[DeviceId],
    profiles: dict[str, BlockProfile],
    budgets: dict[str, int],
) -> InferencePlan:
    """The plan of the spec's mode."""
    seq, names = spec.seq_len, [str(d) for d in devices]
    if spec.mode == "auto":
        step = STEP_LATENCY_S if spec.step_latency_s is None else spec.step_latency_s
        link = Link(spec.link_bps or DEFAULT_LINK_BPS, step)
        return choose(config, names, profiles, budgets, seq, link, overlap=spec.overlap).plan
    if spec.mode == "galaxy":
        return plan_galaxy(config, names, profiles, budgets, seq, overlap=spec.overlap)
    if spec.mode == "megatron":
        return plan_megatron(config, names, seq, budgets)
    if spec.mode == "sp":
        return plan_sp(config, names, seq, budgets)
    return plan_local(config, names, profiles, budgets, seq)


def _loaded(serve: Serve, replies: Mapping[DeviceId, Message], now: float) -> Out:
    """Every shard is in memory: the job runs the request a loss cut off, or the next one."""
    plan = serve.plan
    if plan is None:
        return fail(serve, "serving core out of order: loaded without a plan")
    weights = {d: getattr(m, "weight_bytes", 0) for d, m in replies.items()}
    out: list[Command] = [
        Log("info", "shards loaded", {"weight_bytes": weights}),
        Record(
            "running",
            {
                "plan": plan.model_dump(mode="json"),
                # what the plan was priced on: lets a report set predictions beside measurements
                "profiles": {d: p.model_dump(mode="json") for d, p in serve.profiles.items()},
            },
        ),
        Log(
            "info",
            "serving",
            {"mode": plan.mode, "devices": plan.devices, "heads": plan.heads, "cols": plan.cols},
        ),
    ]
    serve = replace(serve, phase="serving", replanning=False)
    if serve.running is not None:  # the request a loss cut off runs again
        serve, more = run_request(serve, serve.running.req, now, resume=serve.running)
    else:
        serve, more = next_request(serve)
    return serve, [*out, *more]


# --- steps' waits -------------------------------------------------------------------


def _waited(serve: Serve, wait: core.Wait, event: core.Event, now: float) -> Out:
    """Feed the step's wait; on its verdict, go on or fail."""
    wait, commands = core.apply(wait, event, now)
    serve = replace(
        serve,
        wait=wait,
        members=dict(wait.members),
        probes=dict(wait.probes),
        next_nonce=wait.next_nonce,
    )
    out: list[Command] = []
    for cmd in commands:
        if isinstance(cmd, Complete):
            serve, more = _completed(replace(serve, wait=None), cmd.replies, now)
            return serve, [*out, *more]
        if isinstance(cmd, Lost):
            return _lost(replace(serve, wait=None), cmd.devices, cmd.reason, now, out)
        if isinstance(cmd, Fail) and serve.replanning and serve.phase == "profiling":
            # devices joining failed to profile: the job goes on without them, for good
            refused = sorted(wait.want - set(serve.profiles))
            prior = serve.recovery  # not a loss: the recovery timed stays the earlier one
            serve = replace(serve, gone={**serve.gone, **{d: math.inf for d in refused}})
            serve, more = _lost(replace(serve, wait=None), refused, cmd.reason, now, out)
            return (serve if serve.ended else replace(serve, recovery=prior)), more
        if isinstance(cmd, Fail):
            return step_failed(replace(serve, wait=None), cmd.reason, out)
        out.append(cmd)
    return serve, out


def _completed(serve: Serve, replies: Mapping[DeviceId, Message], now: float) -> Out:
    if serve.phase == "profiling":
        return _profiled(serve, replies, now)
    if serve.phase == "loading":
        return _loaded(serve, replies, now)
    back = joiners(serve, now)
    serve, out = answered(serve, replies, now, take_next=not back)
    if back and not serve.ended:
        serve, more = _rejoin(serve, back, now)
        return serve, [*out, *more]
    return serve, out


def _probe_answered(serve: Serve, event: ProbeAnswer, now: float) -> Out:
    """A probe answered between steps clears its suspect, as `core` does within one."""
    open_ = serve.probes.get(event.device)
    if open_ is None or open_.nonce != event.nonce or event.device not in serve.members:
        why = {"device": event.device, "nonce": event.nonce}
        return serve, [Log("info", "ignored a probe answer nobody waits for", why)]
    probes = {d: p for d, p in serve.probes.items() if d != event.device}
    members = heard(serve.members, event.device, now)
    return replace(serve, probes=probes, members=members), [
        Heard(event.device, now),
        Log("info", "suspect answered the probe", {"device": event.device}),
    ]


# --- losses and joins -----------------------------------------------------------------


def _lost(serve: Serve, gone: list[DeviceId], reason: str, now: float, out: list[Command]) -> Out:
    """Re-plan on the survivors under a new epoch; end the job if they cannot hold the model.

    Only once the shards were planned (a loss while joining or first profiling
    fails the job: before any request it is cheaper to start again). A device
    lost while joining the job is simply left out. The request in flight stays
    in flight: it runs again once the new shards are loaded.
    """
    joining = serve.replanning and serve.phase == "profiling"
    if not (joining or serve.phase in ("loading", "serving")) or not serve.profiles:
        return step_failed(serve, reason, out)
    left = [d for d in survivors(serve, gone) if d in serve.profiles]
    if (short := shortfall(serve, left)) is not None:
        why = f"{reason}; the survivors {left} cannot hold the model: {short}"
        return step_failed(serve, why, out)
    record = serve.phase == "serving" or serve.replanning
    kept = {d: at for d, at in serve.gone.items() if d in gone}  # refused joiners stay out
    serve = lost(serve, gone, reason, now)
    serve = replace(
        serve,
        gone={**serve.gone, **kept},
        devices=tuple(left),
        epoch=serve.epoch + 1,
        replanning=False,
    )
    fields = {"lost": list(gone), "survivors": list(left), "epoch": serve.epoch}
    out = [*out, Log("warning", "devices lost; re-planning on the survivors", fields)]
    if record:
        out.append(Record("recovering", {"lost": list(gone), "reason": reason}))
    return _load(replace(serve, phase="loading"), now, out)


def _rejoin(serve: Serve, back: list[DeviceId], now: float) -> Out:
    """Take `back` into the job: profile those never profiled, then re-plan and reload."""
    gone = {d: at for d, at in serve.gone.items() if d not in back}
    devices = tuple(sorted({*serve.devices, *back}))
    serve = replace(serve, devices=devices, gone=gone, epoch=serve.epoch + 1, replanning=True)
    out: list[Command] = [
        Log(
            "info", "devices joined; re-planning with them", {"joined": back, "epoch": serve.epoch}
        ),
        Record("replanning", {"joining": list(back)}),
        SetAssigned(frozenset(devices)),
    ]
    unprofiled = [d for d in back if d not in serve.profiles]
    if not unprofiled or serve.shape is None:
        return _load(replace(serve, phase="loading"), now, out)
    msg = _profile_request(serve, serve.shape)
    serve = replace(serve, phase="profiling")
    serve = begin_step(serve, BlocksProfiled, unprofiled, 0, now, serve.limits.load_timeout_s)
    return serve, [*out, *(Send(d, msg) for d in unprofiled)]


def _profile_request(serve: Serve, shape: TransformerShape) -> ProfileBlocks:
    """Ask a device to time the blocks of `shape` at a few shares of heads, columns and rows."""
    spec = serve.spec
    return ProfileBlocks(
        serve_id=spec.serve_id,
        epoch=serve.epoch,
        model=shape,
        seq_len=spec.seq_len,
        heads=profile_sizes(shape.heads),
        cols=profile_sizes(shape.ffn),
        rows=profile_sizes(spec.seq_len),
    )
