"""Preparation's later steps as pure functions: profiles, links, the cluster, the plan.

`prepare` vets the devices and dispatches events; from profiling on, each
step is here, and each ends by starting the next: profiling (one profile
request outstanding per kind of device missing from the cache, profilers
asked in turn), links (pairs measured in turn, a pair that fails or times out
falls back to the configured bandwidth, never fails the job), the cluster,
planning (the planner service, once known, asked for its plan) and, for a
job's start, the wait for the plan's devices. Every wait's deadline comes
from the `now` the shell passes: nothing here reads a clock or a socket.
"""

from __future__ import annotations

from dataclasses import replace

from common.errors import ConfigError
from common.ids import DeviceId
from common.messages import (
    LinksMeasured,
    MeasureLinks,
    PlanReply,
    PlanRequest,
    ProfileReply,
    ProfileRequest,
)
from common.model_key import model_key
from common.plan import Plan, validate_async
from services.coordinator import links
from services.coordinator.core import Log
from services.coordinator.job_state import Record, Send, SetAssigned, StorePlan
from services.coordinator.prepare_state import (
    Asking,
    Command,
    ForgetLink,
    MeasureLink,
    Measuring,
    Out,
    Prep,
    ProfileFacts,
    ReadClusterBase,
    ReadProfiles,
    StoreCluster,
    StoreLinks,
    fail,
)
from services.coordinator.profiling import batch_sizes, cluster_for

__all__ = [
    "PLANNER",
    "base_read",
    "begin_profiling",
    "devices_heard",
    "link_answered",
    "link_asked",
    "link_timed_out",
    "measure_from",
    "plan_answered",
    "planner_waited",
    "profile_answered",
    "profiler_waited",
    "profiles_read",
    "with_plan",
]

PLANNER = "planner"
"""The planner service's name on the control plane."""


# --- profiling ----------------------------------------------------------------


def begin_profiling(prep: Prep, now: float) -> Out:
    """Find each chosen device's profile key; read the cached ones first (ReadProfiles)."""
    job = prep.job
    sizes = batch_sizes(job.micro_batch or job.global_batch or 1)
    mkey = model_key(job.model)
    keys: dict[DeviceId, str] = {}
    todo: dict[str, Asking] = {}
    for device in sorted(prep.chosen):
        hb = prep.chosen[device].info
        if not hb.fingerprint:
            return fail(prep, f"worker {device} did not report a device fingerprint", config=True)
        keys[device] = f"{mkey}:{hb.fingerprint}"
        if hb.fingerprint not in todo:
            req = ProfileRequest(
                job_id=job.job_id,
                model=job.model,
                fingerprint=hb.fingerprint,
                threads=hb.threads,
                memory_budget=hb.memory_configured,
                batch_sizes=sizes,
                optimizer=job.optimizer.kind,
            )
            todo[hb.fingerprint] = Asking(req, device)
    prep = replace(prep, phase="profiling", keys=keys, todo=tuple(todo.values()), reading="cache")
    return prep, [ReadProfiles(tuple(sorted(set(keys.values()))))]


def profiles_read(prep: Prep, found: dict[str, ProfileFacts | None], now: float) -> Out:
    """Cached profiles known: profile the kinds they do not cover, or go on to the links."""
    budgets = {**prep.budgets, **{k: f.memory_budget if f else 0 for k, f in found.items()}}
    reading, prep = prep.reading, replace(prep, budgets=budgets, reading=None)
    if reading == "budgets":
        return measure_from(prep, now)

    def covered(a: Asking) -> bool:
        facts = found.get(_key(prep, a))
        return facts is not None and set(a.request.batch_sizes) <= set(facts.batch_sizes)

    return _ask_next(replace(prep, todo=tuple(a for a in prep.todo if not covered(a))), now)


def _key(prep: Prep, a: Asking) -> str:
    return f"{model_key(prep.job.model)}:{a.request.fingerprint}"


def _fresh_profilers(prep: Prep, now: float) -> tuple[str, ...]:
    fresh = now - prep.limits.fresh_service_s
    return tuple(
        sorted(n for n, t in prep.services.items() if n.startswith("profiler") and t > fresh)
    )


def _ask_next(prep: Prep, now: float) -> Out:
    """Ask for the first kind still missing (its current or next profiler), or move on."""
    if not prep.todo:
        if prep.profiled and prep.reading is None:  # their budgets, as measured
            prep = replace(prep, reading="budgets")
            return prep, [ReadProfiles(tuple(sorted(set(prep.profiled))))]
        return measure_from(prep, now)
    a, lim = prep.todo[0], prep.limits
    if a.profilers is None:
        found = _fresh_profilers(prep, now)
        if not found:
            if not a.deadline:  # wait a while for one to say hello
                a = replace(a, deadline=now + min(lim.profile_timeout_s, lim.join_timeout_s))
                return replace(prep, todo=(a, *prep.todo[1:])), []
            if now <= a.deadline:
                return prep, []
        a = replace(a, profilers=found, at=0)
    if a.at >= len(a.profilers or ()):
        return _no_profiler(prep, a)
    name = (a.profilers or ())[a.at]
    a = replace(a, deadline=now + lim.profile_timeout_s)
    return replace(prep, todo=(a, *prep.todo[1:])), [Send(DeviceId(name), a.request)]


def _no_profiler(prep: Prep, a: Asking) -> Out:
    if a.late:
        return fail(prep, a.late[0])
    return fail(
        prep,
        f"no profiler service runs on a device like worker {a.device} "
        f"(fingerprint {a.request.fingerprint}; asked {list(a.tried) or 'none'}): start "
        "`asteroid-profiler --serve` on that device",
    )


def profile_answered(prep: Prep, peer: DeviceId, msg: ProfileReply, now: float) -> Out:
    """A profiler answered: the key of that kind, a failure, or "not my kind" (ask the next)."""
    if not prep.todo or prep.reading is not None:
        return prep, []
    a = prep.todo[0]
    if (
        a.profilers is None
        or a.at >= len(a.profilers)
        or peer != a.profilers[a.at]
        or msg.job_id != a.request.job_id
        or msg.fingerprint != a.request.fingerprint
    ):
        return prep, [Log("debug", "ignored a profile reply", {"peer": peer})]
    if msg.ok:
        kind = a.request.fingerprint
        keys = {
            d: msg.key if prep.chosen[d].info.fingerprint == kind else k
            for d, k in prep.keys.items()
        }
        prep = replace(prep, keys=keys, todo=prep.todo[1:], profiled=(*prep.profiled, msg.key))
        return _ask_next(prep, now)
    if msg.mine:
        return fail(prep, f"profiling for worker {a.device} failed on {peer}: {msg.error}")
    a = replace(a, at=a.at + 1, tried=(*a.tried, peer))
    return _ask_next(replace(prep, todo=(a, *prep.todo[1:])), now)


def profiler_waited(prep: Prep, now: float) -> Out:
    """Time passed (or services changed): a profiler that took too long is passed over."""
    if not prep.todo or prep.reading is not None:
        return prep, []
    a = prep.todo[0]
    if a.profilers is None:
        return _ask_next(prep, now)
    if a.at < len(a.profilers) and now > a.deadline:
        name = a.profilers[a.at]
        why = (
            f"{name} did not send the profile of {a.request.fingerprint} "
            f"within {prep.limits.profile_timeout_s:g} s"
        )
        a = replace(a, at=a.at + 1, late=(*a.late, why))
        return _ask_next(replace(prep, todo=(a, *prep.todo[1:])), now)
    return prep, []


# --- links ----------------------------------------------------------------------


def measure_from(prep: Prep, now: float) -> Out:
    """Profiles done: read the cluster spec file (ClusterBaseRead answers), then the links."""
    return replace(prep, phase="links", pairs=(), measuring=None), [ReadClusterBase()]


def base_read(prep: Prep, now: float) -> Out:
    """With the cluster spec known: measure the pairs, unless it gives the links."""
    base = prep.base
    if base is not None and base.links:
        return _cluster(prep, now)
    pairs = links.pairs(prep.chosen) if prep.limits.link_probe_bytes > 0 else []
    return _next_pair(replace(prep, pairs=tuple(pairs), measured=True), now)


def _next_pair(prep: Prep, now: float) -> Out:
    errors = dict(prep.link_errors)
    pairs = list(prep.pairs)
    while pairs:
        prober, target = pairs[0]
        addr = prep.chosen[target].info.link_addr
        if addr:
            prep = replace(
                prep, pairs=tuple(pairs), link_errors=errors, measuring=Measuring(prober, target)
            )
            return prep, [MeasureLink(prober, target, addr)]
        errors[links.pair_key(prober, target)] = f"worker {target} advertises no bandwidth sink"
        pairs.pop(0)
    prep = replace(prep, pairs=(), link_errors=errors, measuring=None)
    return _links_done(prep, now)


def link_asked(prep: Prep, prober: DeviceId, req: MeasureLinks, now: float) -> Out:
    """The shell sent the measurement request: its answer is awaited from now on."""
    m = prep.measuring
    if m is None or m.prober != prober or m.request is not None:
        return prep, []
    wait = prep.limits.link_probe_timeout_s + links.REPLY_SLACK_S
    return replace(prep, measuring=replace(m, request=req, deadline=now + wait)), []


def link_answered(prep: Prep, peer: DeviceId, msg: LinksMeasured, now: float) -> Out:
    """The prober answered: its rates and errors count; the next pair is measured."""
    m = prep.measuring
    if m is None or m.request is None or peer != m.prober or msg.nonce != m.request.nonce:
        return prep, [Log("debug", "ignored a link measurement", {"peer": peer})]
    rates, errors = links.answer(m.request, msg)
    prep = replace(
        prep,
        rates={**prep.rates, **rates},
        link_errors={**prep.link_errors, **errors},
        pairs=prep.pairs[1:],
        measuring=None,
    )
    return _next_pair(prep, now)


def link_timed_out(prep: Prep, now: float) -> Out:
    """A prober that did not answer in time: its pair falls back, the next is measured."""
    m = prep.measuring
    if m is None or m.request is None or now <= m.deadline:
        return prep, []
    wait = prep.limits.link_probe_timeout_s + links.REPLY_SLACK_S
    why = f"{m.prober} did not send the measurement of its link to {m.target} within {wait:g} s"
    key = links.pair_key(m.prober, m.target)
    prep = replace(
        prep, link_errors={**prep.link_errors, key: why}, pairs=prep.pairs[1:], measuring=None
    )
    prep, cmds = _next_pair(prep, now)
    return prep, [ForgetLink(m.prober, m.request.nonce), *cmds]


def _links_done(prep: Prep, now: float) -> Out:
    """Store the matrix and say what was measured and what falls back; then the cluster."""
    devices = tuple(sorted(prep.chosen))
    rates, errors = dict(prep.rates), dict(prep.link_errors)
    cmds: list[Command] = [
        StoreLinks(devices, rates, errors),
        Log(
            "info",
            "links measured",
            {"pairs": len(rates), "links": {k: round(v) for k, v in rates.items()}},
        ),
    ]
    if missing := links.unmeasured(devices, rates):
        off = "measuring is off (link_probe_bytes 0)"
        why = {k: errors.get(k, off) for k in missing}
        cmds.append(
            Log(
                "warning",
                "links not measured: the planner assumes the fallback bandwidth for them",
                {"pairs": missing, "bandwidth": prep.limits.link_bandwidth, "why": why},
            )
        )
    prep, more = _cluster(prep, now)
    return prep, [*cmds, *more]


# --- the cluster and the plan ---------------------------------------------------------


def _cluster(prep: Prep, now: float) -> Out:
    """The cluster the planner sees, stored; then the planner is asked (once it is known)."""
    try:
        cluster = cluster_for(
            dict(prep.chosen),
            dict(prep.keys),
            dict(prep.budgets),
            prep.base,
            prep.limits.link_bandwidth,
            dict(prep.rates) if prep.measured else None,
            prep.slowdowns,
        )
    except ConfigError as exc:
        return fail(prep, str(exc), config=True)
    cmds: list[Command] = [StoreCluster(cluster)]
    if not prep.replan:
        cmds.append(Record("planning", {"planner": prep.job.planner}))
    prep = replace(
        prep,
        phase="planning",
        cluster=cluster,
        deadline=now + prep.limits.plan_timeout_s,
        asked_planner=False,
    )
    prep, more = planner_waited(prep, now)
    return prep, [*cmds, *more]


def _request(prep: Prep) -> PlanRequest:
    job = prep.job
    assert prep.cluster is not None and job.global_batch is not None  # set before planning
    return PlanRequest(
        job_id=job.job_id,
        planner=job.planner,
        cluster=prep.cluster,
        profiles=sorted(set(prep.keys.values())),
        global_batch=job.global_batch,
        microbatches=job.microbatches or 1,
        current=prep.current,
        mode=job.mode,
        aggregate_every=job.aggregate_every,
    )


def planner_waited(prep: Prep, now: float) -> Out:
    """Ask the planner once it is known; give up at the plan timeout, naming who did not come."""
    if not prep.asked_planner and PLANNER in prep.services:
        return replace(prep, asked_planner=True), [Send(DeviceId(PLANNER), _request(prep))]
    if now <= prep.deadline:
        return prep, []
    t = prep.limits.plan_timeout_s
    if not prep.asked_planner:
        return fail(
            prep,
            f"no planner service joined within {t:g} s (start asteroid-planner "
            f"with --coordinator {prep.limits.endpoint})",
        )
    return fail(prep, f"{PLANNER} did not send the plan within {t:g} s")


def plan_answered(prep: Prep, peer: DeviceId, msg: PlanReply, now: float) -> Out:
    """The planner's answer: its plan (a job's start then waits for the plan's devices)."""
    if not prep.asked_planner or peer != PLANNER or msg.job_id != prep.job.job_id:
        return prep, [Log("debug", "ignored a plan reply", {"peer": peer})]
    if not msg.ok or msg.plan is None:
        why = f"planner {prep.job.planner!r} failed: {msg.error or 'no plan sent'}"
        return fail(prep, why, config=True)
    if prep.replan:
        if prep.job.mode == "async":
            try:
                validate_async(msg.plan)
            except ConfigError as exc:
                return fail(prep, str(exc), config=True)
        return replace(prep, phase="ready", plan=msg.plan, current_s=msg.current_round_s), []
    return with_plan(prep, msg.plan, now)


def with_plan(prep: Prep, plan: Plan, now: float) -> Out:
    """A job's plan: checked against the model, stored, its devices awaited."""
    try:
        plan.validate_for(prep.layers)
        if prep.job.mode == "async":
            validate_async(plan)
    except ConfigError as exc:
        return fail(prep, str(exc), config=True)
    prep = replace(prep, phase="devices", plan=plan, deadline=now + prep.limits.join_timeout_s)
    prep, more = devices_heard(prep, now)
    return prep, [StorePlan(plan), SetAssigned(frozenset(plan.devices)), *more]


def devices_heard(prep: Prep, now: float) -> Out:
    """Ready once every device of the plan has sent a heartbeat; failed at the join timeout."""
    plan = prep.plan
    assert plan is not None  # set on entering the phase
    missing = [d for d in plan.devices if d not in prep.members]
    if not missing:
        return replace(prep, phase="ready"), []
    if now <= prep.deadline:
        return prep, []
    return fail(
        prep,
        f"workers {missing} did not join within {prep.limits.join_timeout_s:g} s "
        f"(joined: {sorted(prep.members)})",
    )
