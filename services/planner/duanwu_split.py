"""Duan & Wu's forward/backward split per device: beta, and where a device may split.

The model (Duan & Wu, Sec. III-B): a device that gives a fraction beta of its
compute to forward and 1 - beta to backward runs both at once, a phase on a
share s taking its whole-device time over s. That premise holds only where
the device really divides (two cores or more, each lane pinned to its own,
`services.lib.lanes`); on one core the lanes time-slice and a pair is no
shorter. So whether a device splits is not the model's to say but a
measurement's: `Profile.split_gain` (`services.worker.split_gain`), which must
exceed `SPLIT_MARGIN`. The planner (`services.planner.duanwu`) then lets the
simulator choose between the split plan and the unsplit one.
"""

from __future__ import annotations

import dataclasses

from common.logging import get_logger
from common.plan import Plan, StageSpec
from services.planner.cost import CostModel

__all__ = [
    "BETA_RANGE",
    "SPLIT_MARGIN",
    "betas",
    "clip_beta",
    "log_split",
    "optimal_beta",
    "split_cost",
    "split_devices",
    "split_peaks",
    "split_reasons",
    "split_specs",
    "split_time",
]

INF = float("inf")
log = get_logger(__name__)

# The forward share a plan may give: a lane with almost nothing of the device
# would turn a stray sample or a profiling error into an endless task.
BETA_RANGE = (0.05, 0.95)
SPLIT_MARGIN = 0.02
"""Least measured gain (in-turn pair time over split pair time, minus one) that splits a
device: below it the gain is within what repeated measurements of one pair scatter by."""


def optimal_beta(forward_s: float, backward_s: float) -> float:
    """Forward's share of the device that makes concurrent forward and backward equally long.

    Theorem 1 with c = F / B: beta = c / (c + 1) = F / (F + B); the stage then
    takes `split_time(F, B, beta)` = F + B. A device with no work splits evenly.
    """
    if forward_s < 0 or backward_s < 0:
        raise ValueError(f"phase times must be >= 0, got F={forward_s}, B={backward_s}")
    whole = forward_s + backward_s
    return 0.5 if whole == 0 else forward_s / whole


def clip_beta(beta: float) -> float:
    """`beta` held inside `BETA_RANGE`, the forward share a plan may carry."""
    lo, hi = BETA_RANGE
    return min(max(beta, lo), hi)


def split_time(forward_s: float, backward_s: float, beta: float) -> float:
    """Longer of forward on a `beta` share and backward on the rest (the paper's f and g)."""
    fwd = 0.0 if forward_s == 0 else (INF if beta <= 0 else forward_s / beta)
    bwd = 0.0 if backward_s == 0 else (INF if beta >= 1 else backward_s / (1 - beta))
    return max(fwd, bwd)


def betas(cost: CostModel, plan: Plan) -> dict[str, float]:
    """Each device's optimal forward share for its stage and samples in `plan` (unclipped)."""
    out: dict[str, float] = {}
    for s, spec in enumerate(plan.stages):
        for d, (lo, hi) in plan.ranges(s).items():
            f = cost.compute(d, spec.start, spec.end, hi - lo, "F")
            b = cost.compute(d, spec.start, spec.end, hi - lo, "B")
            out[d] = optimal_beta(f, b)
    return out


def split_devices(plan: Plan) -> dict[str, float | None]:
    """Each device's forward share in `plan` (None: it runs one task at a time)."""
    return {a.device: a.forward_share for spec in plan.stages for a in spec.devices}


def split_reasons(cost: CostModel, plan: Plan) -> dict[str, str | None]:
    """Per device of `plan`: None where it may split, else why it runs one task at a time.

    A device splits only where its profile's measured split gain exceeds
    `SPLIT_MARGIN` (not measured: no split, the model's premise is unchecked)
    and its budget holds the micro-batch the overlap adds (`split_peaks`), so
    the split never makes a plan that fitted overflow.
    """
    budget = {d.name: d.memory_bytes for d in cost.cluster.devices}
    peaks = split_peaks(cost, plan, split=True)
    out: dict[str, str | None] = {}
    for spec in plan.stages:
        for a in spec.devices:
            gain = cost.profile(a.device).split_gain
            if gain is None:
                out[a.device] = "the split's gain was not measured on this device"
            elif gain <= SPLIT_MARGIN:
                out[a.device] = (
                    f"the split measured {gain:+.1%} on this device, "
                    f"not above the {SPLIT_MARGIN:.0%} margin"
                )
            elif peaks[a.device] > budget[a.device]:
                out[a.device] = (
                    f"the overlap's extra micro-batch needs {peaks[a.device]} bytes, "
                    f"more than its {budget[a.device]}"
                )
            else:
                out[a.device] = None
    return out


def split_cost(cost: CostModel, plan: Plan) -> CostModel:
    """`cost` as the simulator should score `plan`: each splitting device sped up by its gain.

    The simulator's split model (a phase on a share s takes its whole-device
    time over s) makes a pair on the lanes last F + B at the optimal beta, no
    shorter than the two in turn. A device's measured gain says how much shorter
    the pair really is, so while it splits its phases take 1 / (1 + gain) of
    their time. Devices that do not split, or gained nothing, are as they were.
    """
    faster: dict[str, float] = {}
    for spec in plan.stages:
        for a in spec.devices:
            gain = cost.profile(a.device).split_gain
            if a.forward_share is not None and gain is not None and gain > 0:
                faster[a.device] = 1.0 + gain
    if not faster:
        return cost
    devices = [
        d.model_copy(update={"slowdown": d.slowdown / faster[d.name]}) if d.name in faster else d
        for d in cost.cluster.devices
    ]
    cluster = cost.cluster.model_copy(update={"devices": devices})
    return dataclasses.replace(cost, cluster=cluster, _prefix={})


def split_specs(cost: CostModel, plan: Plan) -> list[StageSpec]:
    """`plan`'s stages with the clipped optimal beta as forward share where `split_reasons` allow.

    Every other device keeps forward_share None and runs one task at a time.
    """
    shares = betas(cost, plan)
    why = split_reasons(cost, plan)
    return [
        spec.model_copy(
            update={
                "devices": [
                    a.model_copy(
                        update={
                            "forward_share": clip_beta(shares[a.device])
                            if why[a.device] is None
                            else None
                        }
                    )
                    for a in spec.devices
                ]
            }
        )
        for spec in plan.stages
    ]


def split_peaks(cost: CostModel, plan: Plan, split: bool | None = None) -> dict[str, int]:
    """Predicted peak bytes per device when the splitting devices overlap their pair.

    `CostModel.plan_memory` counts K_p micro-batches in flight; a device that
    runs a forward beside a backward holds one more while they overlap (capped
    at M: there are no more). `split` None counts the extra micro-batch for the
    devices whose allocation has a forward share, True for every device.
    """
    base = cost.plan_memory(plan)
    reserved = cost.reserved(plan)
    out: dict[str, int] = {}
    for s, spec in enumerate(plan.stages):
        k = plan.warmup(s)
        ranges = plan.ranges(s)
        for a in spec.devices:
            lo, hi = ranges[a.device]
            if split or (split is None and a.forward_share is not None):
                k_split = min(k + 1, plan.microbatches)
                need = cost.memory(spec.start, spec.end, hi - lo, k_split)
                out[a.device] = need + reserved[a.device]
            else:
                out[a.device] = base[a.device]
    return out


def log_split(cost: CostModel, plan: Plan) -> None:
    """Say, per device of the chosen plan, whether it splits and why (or why not)."""
    why = split_reasons(cost, plan)
    for device, share in split_devices(plan).items():
        if share is not None:
            gain = cost.profile(device).split_gain
            log.info("duanwu split", device=device, beta=round(share, 3), measured_gain=gain)
        else:
            reason = why[device] or "the unsplit plan simulated faster"
            log.info("duanwu no split", device=device, reason=reason)
