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
    LoadShard,
    ProfileBlocks,
    ServeSpec,
    ShardLoaded,
    TransformerShape,
)
from services.coordinator import core
from services.coordinator.core import Beats, Complete, Fail, Heard, Log, Lost, ProbeAnswer, Reply
from services.coordinator.galaxy.planner import (
    plan_galaxy,
    plan_local,
    plan_megatron,
    plan_sp,
    require_capacity,
)
from services.coordinator.job_state import Cancelled, Record, Send, SetAssigned
from services.coordinator.membership import Members, heard
from services.coordinator.serve_requests import (
    answered,
    fail,
    next_request,
    on_cancel,
    on_taken,
    on_waiting,
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
    serve = Serve(spec, limits, epoch, devices, started=now, members=dict(members))
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
        require_capacity(config, _budgets(serve, devices), spec.seq_len)
    except (AsteroidError, ValidationError) as exc:
        return fail(serve, str(exc), out)
    msg = ProfileBlocks(
        serve_id=spec.serve_id,
        epoch=serve.epoch,
        model=shape,
        seq_len=spec.seq_len,
        heads=profile_sizes(shape.heads),
        cols=profile_sizes(shape.ffn),
        rows=profile_sizes(spec.seq_len),
    )
    serve = replace(serve, phase="profiling", shape=shape, config=config)
    serve = begin_step(serve, BlocksProfiled, devices, 0, now, serve.limits.load_timeout_s)
    return serve, [*out, Record("profiling"), *(Send(d, msg) for d in devices)]


def _budgets(serve: Serve, devices: Sequence[DeviceId]) -> dict[str, int]:
    """Each device's memory for its shard: what its heartbeat says training may use."""
    return {d: m.info.memory_budget for d in devices if (m := serve.members.get(d)) is not None}


def _profiled(serve: Serve, replies: Mapping[DeviceId, Message], now: float) -> Out:
    """Plan on the profiles (a wrong seq_len fails the job), then have the shards loaded."""
    spec, config = serve.spec, serve.config
    profiles: dict[str, BlockProfile] = {}
    for d, reply in replies.items():
        if not isinstance(reply, BlocksProfiled):  # the wait takes nothing else
            return fail(serve, f"device {d} answered profiling with {reply.type}")
        if reply.profile.seq_len != spec.seq_len:
            why = f"device {d} profiled seq_len {reply.profile.seq_len}, asked {spec.seq_len}"
            return fail(serve, why)
        profiles[d] = reply.profile
    out: list[Command] = [Record("planning")]
    if config is None or serve.shape is None:
        return fail(serve, "serving core out of order: profiled before the shape was known", out)
    try:
        plan = _plan(spec, config, list(serve.devices), profiles, _budgets(serve, serve.devices))
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
    if spec.mode == "galaxy":
        return plan_galaxy(config, names, profiles, budgets, seq, overlap=spec.overlap)
    if spec.mode == "megatron":
        return plan_megatron(config, names, seq, budgets)
    if spec.mode == "sp":
        return plan_sp(config, names, seq, budgets)
    return plan_local(config, names, profiles, budgets, seq)


def _loaded(serve: Serve, replies: Mapping[DeviceId, Message]) -> Out:
    """Every shard is in memory: the job runs, and the first waiting request is taken."""
    plan = serve.plan
    if plan is None:
        return fail(serve, "serving core out of order: loaded without a plan")
    weights = {d: getattr(m, "weight_bytes", 0) for d, m in replies.items()}
    out: list[Command] = [
        Log("info", "shards loaded", {"weight_bytes": weights}),
        Record("running", {"plan": plan.model_dump(mode="json")}),
        Log(
            "info",
            "serving",
            {"mode": plan.mode, "devices": plan.devices, "heads": plan.heads, "cols": plan.cols},
        ),
    ]
    serve, more = next_request(replace(serve, phase="serving"))
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
        if isinstance(cmd, Fail | Lost):
            return step_failed(replace(serve, wait=None), cmd.reason, out)
        out.append(cmd)
    return serve, out


def _completed(serve: Serve, replies: Mapping[DeviceId, Message], now: float) -> Out:
    if serve.phase == "profiling":
        return _profiled(serve, replies, now)
    if serve.phase == "loading":
        return _loaded(serve, replies)
    return answered(serve, replies, now)


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
