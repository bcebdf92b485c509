"""The Plan: which layers each stage runs, on which devices, with which split.

A plan is data produced by a planner (or written by hand) and consumed by the
coordinator and workers. The pure helpers here (sample ranges, K_p, routing)
are what every worker computes identically, so no extra coordination is needed
to agree on who sends which samples where.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import PlanError
from common.ids import DeviceId

__all__ = [
    "Allocation",
    "Plan",
    "Route",
    "StageSpec",
    "load_plan",
    "routes",
    "split_ranges",
    "validate_async",
]


class Allocation(BaseModel):
    """One device of a stage's group and its relative share of each micro-batch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: DeviceId
    share: int = Field(1, ge=1, description="Relative share of every micro-batch.")
    forward_share: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description=(
            "Duan & Wu's beta: the fraction of the device's compute given to forwards while "
            "backwards get the rest, the two running at once. None: one task at a time."
        ),
    )


class StageSpec(BaseModel):
    """A contiguous layer range [start, end) run data-parallel by a device group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int = Field(ge=0)
    end: int = Field(ge=1)
    devices: list[Allocation] = Field(min_length=1)
    warmup: int | None = Field(
        None, ge=1, description="K_p: forwards in flight; default 2(S-p)-1 capped at M."
    )


class Plan(BaseModel):
    """Stages in pipeline order plus the batch geometry the shares refer to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stages: list[StageSpec] = Field(min_length=1)
    global_batch: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    planner: str = "manual"
    predicted_round_s: float | None = None
    predicted_comm_s: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Of the predicted round, the longest a device spends not computing: waiting for "
            "its peers (transfers, pipeline fill and drain) and all-reducing. 0: unknown."
        ),
    )
    predicted_peak_bytes: dict[str, int] = Field(default_factory=dict)

    @property
    def micro_size(self) -> int:
        """Samples per micro-batch."""
        return self.global_batch // self.microbatches

    @property
    def devices(self) -> list[DeviceId]:
        """Every device of the plan, in stage order."""
        return [a.device for s in self.stages for a in s.devices]

    def stage_of(self, device: DeviceId) -> int:
        """Index of the stage `device` belongs to."""
        for i, stage in enumerate(self.stages):
            if any(a.device == device for a in stage.devices):
                return i
        raise PlanError(f"device {device} is not in the plan (plan has {self.devices})")

    def backup_of(self, stage: int) -> DeviceId | None:
        """The device holding stage `stage`'s replica (Asteroid Fig. 9), or None.

        A single-device stage backs up to the first device of the next stage,
        the last stage to the first's; a multi-device stage is its own replica
        and a one-stage plan has nowhere else to go. Planner, coordinator and
        workers all derive the backup from the plan with this one rule.
        """
        if len(self.stages) == 1 or len(self.stages[stage].devices) > 1:
            return None
        return self.stages[(stage + 1) % len(self.stages)].devices[0].device

    def backups_held(self, device: DeviceId) -> list[int]:
        """The stages whose replica `device` holds, so its memory can count them."""
        return [s for s in range(len(self.stages)) if self.backup_of(s) == device]

    def warmup(self, stage: int) -> int:
        """K_p of `stage`: Asteroid's 2(S-p)-1 unless overridden, never above M."""
        spec = self.stages[stage].warmup
        k = spec if spec is not None else 2 * (len(self.stages) - stage) - 1
        return max(1, min(k, self.microbatches))

    def ranges(self, stage: int) -> dict[DeviceId, tuple[int, int]]:
        """Each device's sample range [lo, hi) inside every micro-batch of `stage`."""
        allocs = self.stages[stage].devices
        spans = split_ranges(self.micro_size, [a.share for a in allocs])
        return {a.device: span for a, span in zip(allocs, spans, strict=True)}

    def validate_for(self, num_layers: int) -> None:
        """Raise PlanError unless the plan can run a model of `num_layers` layers."""
        if self.global_batch % self.microbatches:
            raise PlanError(
                f"global_batch {self.global_batch} is not divisible by "
                f"microbatches {self.microbatches}"
            )
        expected = 0
        for i, stage in enumerate(self.stages):
            if stage.start != expected or stage.end <= stage.start:
                raise PlanError(
                    f"stage {i} covers layers [{stage.start}, {stage.end}); expected a "
                    f"non-empty range starting at {expected}"
                )
            expected = stage.end
        if expected != num_layers:
            raise PlanError(f"stages cover layers [0, {expected}); the model has {num_layers}")
        seen: set[str] = set()
        for device in self.devices:
            if device in seen:
                raise PlanError(f"device {device} appears in more than one place")
            seen.add(device)
        for i in range(len(self.stages)):
            for device, (lo, hi) in self.ranges(i).items():
                if hi <= lo:
                    raise PlanError(
                        f"device {device} in stage {i} gets no sample of a "
                        f"{self.micro_size}-sample micro-batch; raise its share or the batch"
                    )
        for i in range(len(self.stages) - 1):
            if self.warmup(i) < self.warmup(i + 1):
                raise PlanError(
                    f"stage {i} warm-up K={self.warmup(i)} is below stage {i + 1}'s "
                    f"K={self.warmup(i + 1)}; 1F1B would deadlock"
                )


def validate_async(plan: Plan) -> None:
    """Raise PlanError unless `plan` can run `mode: async`: one device per stage, unsplit.

    Every micro-batch updates the weights in async mode, so a data-parallel group
    would all-reduce after each one; and a device split by beta would run a
    forward on a version its backward is changing.
    """
    for i, stage in enumerate(plan.stages):
        if len(stage.devices) != 1:
            raise PlanError(
                f"mode async runs a pipeline of single-device stages; stage {i} has "
                f"{len(stage.devices)} devices (give a plan, or a planner that makes "
                "one: gpipe)"
            )
        if stage.devices[0].forward_share is not None:
            raise PlanError(f"mode async does not split devices; stage {i} has a forward_share")


def split_ranges(total: int, shares: list[int]) -> list[tuple[int, int]]:
    """Split `total` samples into contiguous ranges proportional to `shares`.

    Largest-remainder rounding, ties to the earlier device, so every process
    computes the same split.
    """
    weight = sum(shares)
    exact = [total * s / weight for s in shares]
    counts = [int(e) for e in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    spans, lo = [], 0
    for c in counts:
        spans.append((lo, lo + c))
        lo += c
    return spans


class Route(BaseModel):
    """Samples [lo, hi) of a micro-batch travel from `src` to `dst`."""

    model_config = ConfigDict(frozen=True)

    src: DeviceId
    dst: DeviceId
    lo: int
    hi: int


def routes(
    senders: dict[DeviceId, tuple[int, int]], receivers: dict[DeviceId, tuple[int, int]]
) -> list[Route]:
    """Overlaps of sender and receiver ranges: who sends which samples to whom.

    Forward activations follow these routes; gradients return along the same
    ranges with src and dst swapped, so each sample stays on its device.
    """
    out = []
    for src, (slo, shi) in senders.items():
        for dst, (rlo, rhi) in receivers.items():
            lo, hi = max(slo, rlo), min(shi, rhi)
            if lo < hi:
                out.append(Route(src=src, dst=dst, lo=lo, hi=hi))
    return sorted(out, key=lambda r: (r.lo, r.src))


def load_plan(path: Path) -> Plan:
    """Read a plan from a JSON or YAML file, with errors that name the file."""
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        return Plan.model_validate(data)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        if isinstance(exc, ValidationError):
            raise PlanError(f"plan {path} is invalid: {exc}") from exc
        raise PlanError(f"cannot read plan {path}: {exc}") from exc
