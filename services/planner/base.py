"""The planner interface, the registry of named planners, and their shared checks.

A planner is a pure function of a cost model and the batch geometry: it
returns a `Plan` whose predicted round latency and per-device peak memory are
filled in by `finish`, so every planner's output is scored the same way.
Memory-aware planners raise `PlanDoesNotFit` rather than return a plan that
would run out of memory; memory-unaware baselines return what their paper
would, and `check_memory` says where it breaks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from common.errors import PlanError
from common.ids import DeviceId
from common.plan import Allocation, Plan, StageSpec
from services.planner.cost import CostModel
from services.planner.simulator import estimate, estimate_parts

__all__ = [
    "PlanDoesNotFit",
    "Planner",
    "check_memory",
    "estimate",
    "finish",
    "fmt_bytes",
    "micro_size",
    "require_fits_somewhere",
    "shortfall",
    "stage",
]


class PlanDoesNotFit(PlanError):
    """A memory-aware planner found no plan within the devices' memory budgets."""

    def __init__(self, message: str, violations: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.violations = list(violations)


class Planner(ABC):
    """Turns costs and the batch geometry into a plan; selected by `name`."""

    name: ClassVar[str]

    @abstractmethod
    def plan(self, cost: CostModel, global_batch: int, microbatches: int) -> Plan:
        """The plan for training with `global_batch` samples in `microbatches` per round."""


def fmt_bytes(n: float) -> str:
    """Bytes with one decimal in the largest unit they reach, e.g. "3.1 GiB", "28.0 MiB"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def micro_size(global_batch: int, microbatches: int) -> int:
    """Samples per micro-batch; PlanError unless the batch divides evenly."""
    if microbatches < 1 or global_batch < microbatches or global_batch % microbatches:
        raise PlanError(
            f"global_batch {global_batch} must be a positive multiple of "
            f"microbatches {microbatches}"
        )
    return global_batch // microbatches


def stage(
    start: int, end: int, devices: Sequence[str], shares: Sequence[int], warmup: int | None = None
) -> StageSpec:
    """A StageSpec from parallel lists of devices and their shares."""
    return StageSpec(
        start=start,
        end=end,
        devices=[
            Allocation(device=DeviceId(d), share=s) for d, s in zip(devices, shares, strict=True)
        ],
        warmup=warmup,
    )


def check_memory(plan: Plan, cost: CostModel) -> list[str]:
    """One line per device whose predicted peak exceeds its budget, in plan order."""
    out = []
    for device, need in cost.plan_memory(plan).items():
        have = cost.cluster.device(device).memory_bytes
        if need > have:
            out.append(f"device {device} needs {fmt_bytes(need)}, has {fmt_bytes(have)}")
    return out


def require_fits_somewhere(cost: CostModel, micro: int) -> None:
    """PlanError when no plan at all can fit, whatever the planner.

    Two lower bounds: every layer's weights, gradients and optimizer state plus
    one sample's activations must fit on the largest device (a stage keeps its
    whole range on each member); and the whole model's states plus one
    micro-batch's activations (each sample lives on exactly one device per
    layer) must fit in all devices' memory together.
    """
    devices = cost.cluster.devices
    largest = max(devices, key=lambda d: d.memory_bytes)
    for layer in range(cost.num_layers):
        need = cost.memory(layer, layer + 1, 1, 1)
        if need > largest.memory_bytes:
            raise PlanError(
                f"the model fits nowhere: layer {layer} alone needs {fmt_bytes(need)} "
                f"(weights, gradients, optimizer state and one sample's activations), "
                f"the largest device {largest.name} has {fmt_bytes(largest.memory_bytes)}"
            )
    states = cost.memory(0, cost.num_layers, 0, 1)
    acts = cost.memory(0, cost.num_layers, micro, 1) - states
    total = sum(d.memory_bytes for d in devices)
    if states + acts > total:
        raise PlanError(
            f"the model fits nowhere: it needs at least {fmt_bytes(states + acts)} "
            f"({fmt_bytes(states)} of weights, gradients and optimizer state plus "
            f"{fmt_bytes(acts)} of activations for one {micro}-sample micro-batch), "
            f"all {len(devices)} devices together have {fmt_bytes(total)}"
        )


def shortfall(plan: Plan, cost: CostModel) -> list[str]:
    """`check_memory` lines with the missing bytes appended, worst first."""
    rows = []
    for device, need in cost.plan_memory(plan).items():
        have = cost.cluster.device(device).memory_bytes
        if need > have:
            rows.append(
                (
                    need - have,
                    f"device {device} needs {fmt_bytes(need)}, has "
                    f"{fmt_bytes(have)} (short by {fmt_bytes(need - have)})",
                )
            )
    return [line for _, line in sorted(rows, key=lambda r: -r[0])]


def finish(
    name: str,
    cost: CostModel,
    stages: list[StageSpec],
    global_batch: int,
    microbatches: int,
    *,
    memory_aware: bool,
) -> Plan:
    """Assemble, validate and score a plan; PlanDoesNotFit if memory-aware and over budget."""
    plan = Plan(stages=stages, global_batch=global_batch, microbatches=microbatches, planner=name)
    plan.validate_for(cost.num_layers)
    if memory_aware:
        over = shortfall(plan, cost)
        if over:
            raise PlanDoesNotFit(
                f"planner {name} found no plan within the memory budgets; its best "
                f"plan overshoots: {'; '.join(over)}",
                over,
            )
    round_s, comm_s = estimate_parts(plan, cost)
    return plan.model_copy(
        update={
            "predicted_round_s": round_s,
            "predicted_comm_s": comm_s,
            "predicted_peak_bytes": cost.plan_memory(plan),
        }
    )
