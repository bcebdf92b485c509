"""Discrete-event simulation of one HPP round, and Asteroid's analytic estimate.

`simulate` replays a plan the way the runtime runs it (services/worker/stage.py):
every device asks the same pure `next_task` what to run, forwards wait until all
routed activation parts of a micro-batch have arrived, gradients return along
the same routes, transfers occupy their directed link (FIFO) while compute goes
on, and each stage group all-reduces once all its devices finished their last
backward. Because the decisions come from the worker's own scheduler, the
simulator scores a plan under the exact schedule the workers will follow.

A device whose allocation has a `forward_share` beta (Duan & Wu) asks
`next_pair` instead and starts the backward and the forward it returns
together, each on its own lane: a forward lasts F / beta, a backward
B / (1 - beta), also when it runs without a partner. Like the worker, it makes
its next decision only once both have ended (it joins the pair), while each
action's sends leave as soon as that action ends. Both kinds of device share
one event loop; they differ only in the decision function and the lane rates.

`estimate` is the cheap closed form planners use inside their search loops; the
simulator is the referee that checks it (tests/planner/test_simulator.py).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from common.errors import PlanError
from common.plan import Plan, Route, routes
from common.schedule import POLICIES, Action, PoolView, next_pair, next_task
from services.planner.cost import CostModel

__all__ = ["Event", "SimResult", "estimate", "estimate_parts", "simulate"]

EventKind = Literal["F", "B", "send", "recv", "allreduce"]


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of a device's round: compute, a transfer end, or the all-reduce.

    A transfer appears twice: as "send" on the sender and "recv" on the receiver
    (same interval, `peer` names the other side). `mb` is -1 for the all-reduce.
    """

    device: str
    kind: EventKind
    start: float
    end: float
    mb: int
    peer: str = ""


@dataclass
class SimResult:
    """Outcome of one simulated round.

    Attributes:
        round_s: Seconds from round start until the last all-reduce (or, for a
            single-device group, the last backward) ends. The optimizer step is
            not simulated: it is the same on every plan that keeps the same
            parameters per device and would only shift all plans alike.
        bubble_fraction: Share of device capacity not spent in forward or
            backward (waiting, and the all-reduce) over all devices and the
            whole round. A lane counts with its share of the device, so a
            device splitting its compute is idle in part when one lane is.
        peak_bytes: Per device, `CostModel.memory` with the simulated peak of
            alive micro-batches (`max_alive`), not just K_p.
        max_alive: Per device, the most micro-batches whose activations were
            kept for backward at once. A forward that runs beside a backward
            counts from its start: it builds its activations while the
            backward still holds its own, one micro-batch more than a device
            running one task at a time reaches.
        events: Every compute, transfer and all-reduce interval, in start order.
            A splitting device's forward and backward intervals overlap.
        samples: Samples the round trains on (micro-batch size x micro-batches).

    """

    round_s: float
    bubble_fraction: float
    peak_bytes: dict[str, int]
    max_alive: dict[str, int]
    events: list[Event]
    samples: int

    @property
    def throughput(self) -> float:
        """Training samples per second."""
        return self.samples / self.round_s if self.round_s > 0 else float("inf")


@dataclass
class _Device:
    """Mutable state of one simulated worker (its pool and scheduler progress).

    `f_s` and `b_s` are the task durations on the device's lanes, `f_rate` and
    `b_rate` the share of the device each lane gets (1 for a device that runs
    one task at a time, beta and 1 - beta for one that splits).
    """

    name: str
    stage: int
    f_s: float
    b_s: float
    fwd_routes: list[Route]  # activations it sends downstream
    bwd_routes: list[Route]  # gradients it sends upstream (route src is the receiver)
    fwd_parts: int  # activation parts that complete a forward task
    bwd_parts: int  # gradient parts that complete a backward task
    split: bool = False  # runs next_pair's forward and backward side by side
    f_rate: float = 1.0
    b_rate: float = 1.0
    next_f: int = 0
    done_b: int = 0
    running: int = 0  # actions started at the last decision and not yet ended
    alive: set[int] = field(default_factory=set)
    max_alive: int = 0
    f_got: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    b_got: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    f_ready: set[int] = field(default_factory=set)
    b_ready: set[int] = field(default_factory=set)
    finished_at: float | None = None


def simulate(plan: Plan, cost: CostModel, policy: str = "1f1b") -> SimResult:
    """Simulate one training round of `plan` under `cost` with the worker's scheduler.

    Ties at the same instant are resolved as arrivals first, then decisions, so
    a zero-cost transfer never costs a scheduling opportunity. The plan is not
    put through `Plan.validate_for`: plans the runtime would hang on (e.g. a
    device with no samples outside stage 0) are reported as deadlocks instead.

    Raises:
        PlanError: a device appears twice, a stage leaves the model, or the
            round cannot finish (naming the stuck stages and what they wait for).
        ValueError: `policy` is not one of the worker's policies.

    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    devs = _build(plan, cost)
    m, last = plan.microbatches, len(plan.stages) - 1
    ks = [plan.warmup(s) for s in range(len(plan.stages))]
    events: list[Event] = []
    heap: list[tuple[float, int, str, str, int]] = []  # (time, seq, what, device, mb)
    link_free: dict[tuple[str, str], float] = defaultdict(float)
    seq = 0

    def push(t: float, what: str, device: str, mb: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, what, device, mb))
        seq += 1

    def send(src: str, dst: str, nbytes: int, now: float, mb: int, what: str) -> None:
        start = max(now, link_free[src, dst])
        end = start + cost.transfer(src, dst, nbytes)
        link_free[src, dst] = end
        events.append(Event(src, "send", start, end, mb, dst))
        events.append(Event(dst, "recv", start, end, mb, src))
        push(end, what, dst, mb)

    def decide(d: _Device, now: float) -> None:
        view = PoolView(
            next_forward=d.next_f,
            alive=len(d.alive),
            forward_ready=frozenset(range(m)) if d.stage == 0 else frozenset(d.f_ready),
            backward_ready=frozenset(d.alive) if d.stage == last else frozenset(d.b_ready),
        )
        if d.split:
            actions = [a for a in next_pair(view, d.stage, ks[d.stage], m, policy) if a]
        else:
            actions = [a for a in [next_task(view, d.stage, ks[d.stage], m, policy)] if a]
        if len(actions) == 2:  # the forward's activations grow beside the backward's
            d.max_alive = max(d.max_alive, len(d.alive) + 1)
        for action in actions:
            d.running += 1
            if action.kind == "F":
                d.f_ready.discard(action.mb)
                end = now + d.f_s
            else:
                d.b_ready.discard(action.mb)
                end = now + d.b_s
            events.append(Event(d.name, action.kind, now, end, action.mb))
            push(end, action.kind, d.name, action.mb)

    def finish(d: _Device, action: Action, now: float) -> None:
        d.running -= 1
        stage = plan.stages[d.stage]
        if action.kind == "F":
            d.next_f += 1
            d.alive.add(action.mb)
            d.max_alive = max(d.max_alive, len(d.alive))
            for r in d.fwd_routes:
                nbytes = cost.boundary_bytes(stage.end, r.hi - r.lo)
                send(d.name, r.dst, nbytes, now, action.mb, "f_part")
            return
        d.alive.discard(action.mb)
        d.done_b += 1
        for r in d.bwd_routes:
            nbytes = cost.boundary_bytes(plan.stages[d.stage - 1].end, r.hi - r.lo)
            send(d.name, r.src, nbytes, now, action.mb, "b_part")
        if d.done_b == m:
            d.finished_at = now
            _maybe_allreduce(plan, cost, devs, d.stage, events)

    for d in devs.values():
        decide(d, 0.0)
    while heap:
        now = heap[0][0]
        dirty: dict[str, _Device] = {}
        while heap and heap[0][0] <= now:
            _, _, what, name, mb = heapq.heappop(heap)
            d = devs[name]
            dirty[name] = d
            if what == "f_part":
                d.f_got[mb] += 1
                if d.f_got[mb] == d.fwd_parts:
                    d.f_ready.add(mb)
            elif what == "b_part":
                d.b_got[mb] += 1
                if d.b_got[mb] == d.bwd_parts:
                    d.b_ready.add(mb)
            else:
                finish(d, Action(d.stage, "F" if what == "F" else "B", mb), now)
        for d in dirty.values():
            if not d.running and d.done_b < m:
                decide(d, now)

    stuck = [d for d in devs.values() if d.done_b < m]
    if stuck:
        raise PlanError(_deadlock_message(stuck, m, last))
    return _result(plan, cost, devs, events)


def _build(plan: Plan, cost: CostModel) -> dict[str, _Device]:
    """Per-device state with its routes, lane rates, task durations and part counts."""
    seen: set[str] = set()
    for s, stage in enumerate(plan.stages):
        if not 0 <= stage.start < stage.end <= cost.num_layers:
            raise PlanError(
                f"stage {s} covers layers [{stage.start}, {stage.end}); the model has "
                f"{cost.num_layers}"
            )
        for a in stage.devices:
            if a.device in seen:
                raise PlanError(f"device {a.device} appears in more than one place")
            seen.add(a.device)
    links = [routes(plan.ranges(s), plan.ranges(s + 1)) for s in range(len(plan.stages) - 1)]
    devs: dict[str, _Device] = {}
    for s, stage in enumerate(plan.stages):
        down = links[s] if s < len(links) else []
        up = links[s - 1] if s > 0 else []
        betas = {a.device: a.forward_share for a in stage.devices}
        for name, (lo, hi) in plan.ranges(s).items():
            fwd = [r for r in down if r.src == name]
            bwd = [r for r in up if r.dst == name]
            beta = betas[name]
            f_rate, b_rate = (1.0, 1.0) if beta is None else (beta, 1.0 - beta)
            devs[name] = _Device(
                name=name,
                stage=s,
                f_s=cost.compute(name, stage.start, stage.end, hi - lo, "F") / f_rate,
                b_s=cost.compute(name, stage.start, stage.end, hi - lo, "B") / b_rate,
                split=beta is not None,
                f_rate=f_rate,
                b_rate=b_rate,
                fwd_routes=fwd,
                bwd_routes=bwd,
                # the worker's pool needs parts covering its whole (non-empty) span
                fwd_parts=len(bwd) if hi > lo else -1,
                bwd_parts=len(fwd) if hi > lo else -1,
            )
    return devs


def _maybe_allreduce(
    plan: Plan, cost: CostModel, devs: dict[str, _Device], s: int, events: list[Event]
) -> None:
    """Start stage `s`'s ring all-reduce once every device of its group finished."""
    group = [a.device for a in plan.stages[s].devices]
    ends = [devs[g].finished_at for g in group]
    if len(group) == 1 or any(e is None for e in ends):
        return
    start = max(e for e in ends if e is not None)
    end = start + cost.allreduce(group, plan.stages[s].start, plan.stages[s].end)
    events.extend(Event(g, "allreduce", start, end, -1) for g in group)


def _deadlock_message(stuck: list[_Device], m: int, last: int) -> str:
    """Name each stuck stage and what its first stuck device waits for."""
    by_stage: dict[int, _Device] = {}
    for d in stuck:
        by_stage.setdefault(d.stage, d)
    parts = []
    for s, d in sorted(by_stage.items()):
        if d.alive and s != last:
            what = f"gradients of micro-batches {sorted(d.alive)} from stage {s + 1}"
        elif d.next_f < m and s > 0:
            what = f"activations of micro-batch {d.next_f} from stage {s - 1}"
        else:
            what = f"a task it may run (next forward {d.next_f}, alive {sorted(d.alive)})"
        parts.append(f"stage {s} (device {d.name} waits for {what})")
    return (
        f"the round cannot finish: {len(stuck)} device(s) stuck after "
        f"{min(d.done_b for d in stuck)}/{m} backwards; " + "; ".join(parts)
    )


def _result(
    plan: Plan, cost: CostModel, devs: dict[str, _Device], events: list[Event]
) -> SimResult:
    events.sort(key=lambda e: (e.start, e.end, e.device))
    round_s = max((e.end for e in events), default=0.0)
    rate = {(n, k): r for n, d in devs.items() for k, r in (("F", d.f_rate), ("B", d.b_rate))}
    busy = sum((e.end - e.start) * rate[e.device, e.kind] for e in events if e.kind in ("F", "B"))
    bubble = 1.0 - busy / (len(devs) * round_s) if round_s > 0 else 0.0
    peak: dict[str, int] = {}
    for s, stage in enumerate(plan.stages):
        for name, (lo, hi) in plan.ranges(s).items():
            peak[name] = cost.memory(stage.start, stage.end, hi - lo, devs[name].max_alive)
    return SimResult(
        round_s=round_s,
        bubble_fraction=bubble,
        peak_bytes=peak,
        max_alive={name: d.max_alive for name, d in devs.items()},
        events=events,
        samples=plan.micro_size * plan.microbatches,
    )


def estimate(plan: Plan, cost: CostModel) -> float:
    """Asteroid's dominant-step estimate of one round's latency, in seconds.

    Every stage is a pipeline step lasting its slowest device's forward plus
    backward of one micro-batch share, and so is every stage boundary, lasting
    its slowest route's activation transfer plus gradient transfer. With steps
    t_1..t_n (stages and boundaries in pipeline order) and M micro-batches::

        latency = sum(t_i) + (M - 1) * max(t_i) + max over stages of all-reduce

    The first term fills and drains the pipeline once, the second is the
    steady state paced by the bottleneck step, the third the group
    synchronisation at round end (groups all-reduce in parallel). It ignores
    link contention and the overlap of a boundary's two directions, so it is a
    planning heuristic: `simulate` gives the schedule-exact figure.
    """
    return estimate_parts(plan, cost)[0]


def estimate_parts(plan: Plan, cost: CostModel) -> tuple[float, float]:
    """`estimate`'s round, and the part of it the most idle device spends not computing.

    A device computes M times its own step; the rest of the round it waits for
    its peers (their transfers, the pipeline's fill and drain, slower stages)
    or all-reduces. That is what a worker reports as `wait_s + allreduce_s`,
    so the job can compare the two: a plan made on fast links predicts little
    beyond the pipeline's own bubbles.
    """
    steps: list[float] = []
    reduce = 0.0
    fastest = float("inf")
    for s, stage in enumerate(plan.stages):
        ranges = plan.ranges(s)
        own = [cost.step(d, stage.start, stage.end, hi - lo) for d, (lo, hi) in ranges.items()]
        steps.append(max(own))
        fastest = min(fastest, *own)
        group = [a.device for a in stage.devices]
        reduce = max(reduce, cost.allreduce(group, stage.start, stage.end))
        if s + 1 < len(plan.stages):
            comm = [
                cost.transfer(r.src, r.dst, nbytes) + cost.transfer(r.dst, r.src, nbytes)
                for r in routes(ranges, plan.ranges(s + 1))
                for nbytes in [cost.boundary_bytes(stage.end, r.hi - r.lo)]
            ]
            steps.append(max(comm, default=0.0))
    round_s = sum(steps) + (plan.microbatches - 1) * max(steps) + reduce
    return round_s, max(0.0, round_s - plan.microbatches * fastest)
