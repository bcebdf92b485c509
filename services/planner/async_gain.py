"""What async pipelining without a drain gains over sync, predicted from per-stage costs.

A sync window (a round) fills the pipeline, runs 1F1B, drains it, then every
stage steps its optimizer once: its length is `simulate`'s round (the worker's
own scheduler, so fill and drain are the real ones) plus the step. Async
without a drain (PipeDream, FTPipeHD) never empties the pipeline: micro-batches
of the next window enter while the last ones of this window drain, so in the
steady state a window lasts M times the bottleneck stage's time per
micro-batch, and that time now includes an optimizer step and a weight-version
snapshot after every backward (sync steps once a window).

So async pays where sync's bubble (fill and drain, idle on a faster stage) is
larger than what the per-micro-batch updates add: few micro-batches per window,
many stages, cheap updates. With many micro-batches the bubble is amortised
and the updates can make async slower. `predict` says which, from measured or
profiled costs; the bench compares it with what the devices measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import PlanError
from common.plan import Allocation, Plan, StageSpec, validate_async
from common.profile import ClusterSpec, DeviceSpec, LayerProfile, Profile
from services.planner.cost import CostModel
from services.planner.simulator import SimResult, simulate

__all__ = ["AsyncGain", "StageCost", "predict", "predict_plan"]


@dataclass(frozen=True)
class StageCost:
    """One single-device stage's seconds per micro-batch, and its optimizer's.

    Attributes:
        forward_s: One micro-batch's forward.
        backward_s: One micro-batch's backward (without the async update).
        step_s: Sync: the one optimizer step of the stage's layers at a window's end.
        update_s: Async: what each micro-batch's update adds after its backward
            (an optimizer step and a snapshot of the new weight version).

    """

    forward_s: float
    backward_s: float
    step_s: float = 0.0
    update_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s, self.step_s, self.update_s) < 0:
            raise ValueError(f"a stage's costs cannot be negative: {self}")


@dataclass(frozen=True)
class AsyncGain:
    """The predicted windows of both modes at one number of micro-batches.

    Attributes:
        microbatches: M, micro-batches per window.
        sync_window_s: Fill, 1F1B steady state and drain (the simulator's
            round), then the slowest finishing stage's optimizer step.
        async_window_s: M times the bottleneck stage's forward, backward and update.
        sync_bubble: The share of the sync window its bottleneck stage spends
            not computing forwards and backwards (fill, drain, the step): what
            a pipeline that never drains removes, so that with free updates
            async is 1 / (1 - sync_bubble) times faster.
        bottleneck: The stage that paces async.

    """

    microbatches: int
    sync_window_s: float
    async_window_s: float
    sync_bubble: float
    bottleneck: int

    @property
    def speedup(self) -> float:
        """Async throughput over sync's (same samples a window): above 1, async pays."""
        return self.sync_window_s / self.async_window_s if self.async_window_s > 0 else 0.0

    @property
    def pays(self) -> bool:
        """Whether async is predicted to beat plain sync on this plan."""
        return self.speedup > 1.0

    def describe(self) -> str:
        """One line for a plan's report."""
        verdict = "async pays" if self.pays else "async does not pay: keep sync"
        return (
            f"M={self.microbatches}: sync window {self.sync_window_s * 1e3:.1f} ms "
            f"(bubble {self.sync_bubble:.0%}), async without drain "
            f"{self.async_window_s * 1e3:.1f} ms: {self.speedup:.2f}x, {verdict}"
        )


def _gain(
    sim: SimResult, stages: Sequence[StageCost], names: Sequence[str], microbatches: int
) -> AsyncGain:
    """Both windows from a simulated sync round and the stages' costs (device `names[s]`)."""
    ends = {n: 0.0 for n in names}
    for e in sim.events:
        if e.kind in ("B", "allreduce"):
            ends[e.device] = max(ends[e.device], e.end)
    sync_s = max(ends[n] + st.step_s for n, st in zip(names, stages, strict=True))
    busy = microbatches * max(st.forward_s + st.backward_s for st in stages)
    bubble = 1.0 - busy / sync_s if sync_s > 0 else 0.0
    per_mb = [st.forward_s + st.backward_s + st.update_s for st in stages]
    bottleneck = max(range(len(stages)), key=per_mb.__getitem__)
    return AsyncGain(microbatches, sync_s, microbatches * per_mb[bottleneck], bubble, bottleneck)


def predict(stages: Sequence[StageCost], microbatches: int) -> AsyncGain:
    """Sync against no-drain async for a pipeline of single-device stages with these costs.

    The sync round is simulated on a plan of one layer per stage whose profile
    carries the stages' own times (links free: on the measured pipelines the
    activations are small against the compute), so fill, drain and the waits
    come from the worker's scheduler, not from a formula.
    """
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    if microbatches < 1:
        raise ValueError(f"micro-batches per window must be at least 1, not {microbatches}")
    names = [f"stage-{s}" for s in range(len(stages))]
    profile = Profile(
        model="measured",
        device="measured",
        batch_sizes=[1],
        layers=[
            LayerProfile(
                index=s,
                forward_s=[st.forward_s],
                backward_s=[st.backward_s],
                output_bytes=0,
                activation_bytes=0,
                param_bytes=0,
                optimizer_bytes=0,
            )
            for s, st in enumerate(stages)
        ],
    )
    cluster = ClusterSpec(
        devices=[DeviceSpec(name=n, memory_bytes=1 << 30, profile="measured") for n in names],
        bandwidth=1e18,
    )
    plan = Plan(
        global_batch=microbatches,
        microbatches=microbatches,
        stages=[
            StageSpec(start=s, end=s + 1, devices=[Allocation(device=n)])
            for s, n in enumerate(names)
        ],
    )
    sim = simulate(plan, CostModel({"measured": profile}, cluster))
    return _gain(sim, stages, names, microbatches)


def predict_plan(
    plan: Plan, cost: CostModel, step_s: Sequence[float], update_s: Sequence[float]
) -> AsyncGain:
    """`predict` for a planned pipeline: its simulated round, with links, and its stages' costs.

    `step_s[s]` and `update_s[s]` are stage s's optimizer step and per-micro-batch
    update (see `StageCost`); the profiles do not measure them.

    Raises:
        PlanError: the plan cannot run async (a group or a split device).

    """
    validate_async(plan)
    if len(step_s) != len(plan.stages) or len(update_s) != len(plan.stages):
        raise PlanError(f"{len(plan.stages)} stages need as many step and update costs")
    names = [str(st.devices[0].device) for st in plan.stages]
    micro = plan.micro_size
    stages = [
        StageCost(
            cost.compute(n, st.start, st.end, micro, "F"),
            cost.compute(n, st.start, st.end, micro, "B"),
            step,
            update,
        )
        for n, st, step, update in zip(names, plan.stages, step_s, update_s, strict=True)
    ]
    return _gain(simulate(plan, cost), stages, names, plan.microbatches)
