"""The split's measured gain per stage, and the planner's decision per device from it.

For each stage of the depth-4 plan (the layer range its device runs, at the
micro-batch), a forward of one micro-batch beside the backward of another
(`services.worker.split_gain`), against the two one after the other:

- on this machine, with the measuring thread bound to ONE core (the lanes
  time-slice it; no pinning) and to TWO cores (each lane pinned to its own);
- inside each emulated device (its cpuset and CPU quota), as a process the
  testbed starts there: the gain the planner is given for that device.

The planner's decision per device (`services.planner.duanwu.split_reasons`) is
taken from each of these: with gains from one core, from two cores, and from the
devices themselves (the `planner` variant the epoch part runs).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, Profile
from services.lib.split_gain import layer_range, measure_split_gain, with_split_gain
from services.planner.cost import CostModel
from services.planner.duanwu import split_cost, split_reasons, split_specs
from services.planner.simulator import simulate
from tests.bench.duanwu_split_common import MODELS, fmt

WHERE = ("one core", "two cores", "device")
"""Where a gain was measured: this machine bound to one core, to two, inside the device."""

__all__ = [
    "StageGain",
    "device_gain",
    "gain_cost",
    "gain_table",
    "host_gains",
    "planner_variant",
]


@dataclass
class StageGain:
    """One stage's measurements (SplitGain dicts) and the planner's decision from each."""

    model: str
    device: str
    layers: tuple[int, int]
    micro: int
    host_one: dict[str, Any] | None = None
    host_two: dict[str, Any] | None = None
    on_device: dict[str, Any] | None = None
    decisions: dict[str, str] = field(default_factory=dict)
    """Where the gains came from ("one core", "two cores", "device") -> split or why not."""

    def gain(self, where: str) -> float | None:
        got = {"one core": self.host_one, "two cores": self.host_two, "device": self.on_device}
        m = got[where]
        return None if m is None else float(m["gain"])


def stage_gains(model: str, plan: Plan, registry: dict[str, Any] = MODELS) -> list[StageGain]:
    """One empty `StageGain` per stage of `plan` (one device per stage)."""
    micro = int(registry[model]["micro"])
    return [StageGain(model, s.devices[0].device, (s.start, s.end), micro) for s in plan.stages]


def host_gains(
    rows: Sequence[StageGain], repeats: int, cores: Sequence[int], registry: dict[str, Any] = MODELS
) -> None:
    """Fill each row's one-core and two-core measurements on this machine's `cores`."""
    for r in rows:
        module, x = layer_range(registry[r.model]["spec"], *r.layers, r.micro)
        r.host_one = measure_split_gain(module, x, repeats=repeats, cores=cores[-1:]).as_dict()
        r.host_two = measure_split_gain(module, x, repeats=repeats, cores=cores[:2]).as_dict()
        print(
            f"gain {r.model} {r.layers}: one core {r.host_one['gain']:+.3f}, "
            f"two cores {r.host_two['gain']:+.3f}",
            flush=True,
        )


def device_gain(bed: Any, row: StageGain, repeats: int, registry: dict[str, Any] = MODELS) -> None:
    """Fill `row.on_device`: the measurement run as a process inside its emulated device."""
    cmd = [sys.executable, "-m", "services.worker.split_gain"]
    cmd += ["--model", json.dumps(registry[row.model]["spec"])]
    cmd += ["--layers", str(row.layers[0]), str(row.layers[1]), "--micro", str(row.micro)]
    cmd += ["--repeats", str(repeats)]
    done = bed.run(row.device, cmd, timeout_s=300.0)
    if done.returncode != 0:
        print(f"gain on {row.device} failed: {done.stderr[-2000:]}", file=sys.stderr)
        return
    row.on_device = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"gain {row.model} on {row.device}: {row.on_device['gain']:+.3f}", flush=True)


def gain_cost(cost: CostModel, gains: dict[str, float | None]) -> CostModel:
    """`cost` with each device on a profile of its own carrying its measured split gain."""
    devices = [
        DeviceSpec(name=d.name, memory_bytes=d.memory_bytes, profile=d.name, slowdown=d.slowdown)
        for d in cost.cluster.devices
    ]
    profiles: dict[str, Profile] = {
        d.name: with_split_gain(cost.profile(d.name), g)
        if (g := gains.get(d.name)) is not None
        else cost.profile(d.name)
        for d in cost.cluster.devices
    }
    cluster = cost.cluster.model_copy(update={"devices": devices})
    assert isinstance(cluster, ClusterSpec)
    return CostModel(profiles, cluster)


def decide(cost: CostModel, plan: Plan, rows: Sequence[StageGain], where: str) -> None:
    """Record in `rows` what the planner decides for each device from the gains `where`."""
    gcost = gain_cost(cost, {r.device: r.gain(where) for r in rows})
    why = split_reasons(gcost, plan)
    for r in rows:
        reason = why[r.device]
        r.decisions[where] = "split" if reason is None else f"no: {reason}"


def planner_variant(cost: CostModel, plan: Plan, rows: Sequence[StageGain]) -> tuple[Plan, str]:
    """`plan` as `DuanWuPlanner.plan` would run it from the gains measured inside the devices.

    The devices whose gain clears the margin split (`split_specs`), and the
    split plan is kept only if the simulator's round is shorter than the
    unsplit one's (the planner's choice between its two candidates). Returns
    the plan and a sentence saying what was chosen and why.
    """
    gcost = gain_cost(cost, {r.device: r.gain("device") for r in rows})
    split = plan.model_copy(update={"stages": split_specs(gcost, plan)})
    allowed = [a.device for s in split.stages for a in s.devices if a.forward_share is not None]
    if not allowed:
        return plan, "no device's measured gain clears the margin: nothing split"
    s_split = simulate(split, split_cost(gcost, split)).round_s
    s_plain = simulate(plan, gcost).round_s
    said = f"gains allow {', '.join(allowed)}; simulated round {s_split:.2f} s split"
    if s_split < s_plain:
        return split, f"{said} < {s_plain:.2f} s unsplit: split"
    return plan, f"{said} >= {s_plain:.2f} s unsplit: not split"


def gain_table(rows: Sequence[StageGain]) -> list[str]:
    """Markdown: per stage, the pair in turn vs split and the gain, where measured."""

    def cell(m: dict[str, Any] | None) -> str:
        if m is None:
            return "— | — | —"
        best = min(t for t in (m["in_turn_s"], m.get("in_turn_one_s", 0.0)) if t > 0)
        threads = m.get("best_threads", m.get("cores", 1))
        split, gain = m["split_s"] * 1e3, m["gain"] * 100
        return f"{best * 1e3:.1f} ({threads} thr) | {split:.1f} | {gain:+.1f} %"

    lines = [
        "## 1. The split's measured gain per stage, and the planner's decision",
        "",
        "Pair = forward of one micro-batch + backward of another; in turn unsplit at its "
        "best thread count (the faster of one intra-op thread per core and a single thread, "
        "both measured; in brackets, the count) vs at once on the lanes (pinned on two "
        "cores). Gain = best in-turn / split - 1 (medians, taken in turns): the split "
        "against the best unsplit way, as the planner weighs it.",
        "",
        "| model | device | layers | F / B ms (2 cores) | one core: in turn ms | split ms | gain "
        "| two cores: in turn ms | split ms | gain | in the device: in turn ms | split ms | gain "
        "| planner, from one core | from two cores | from the device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        two = r.host_two
        fb = "—" if two is None else f"{two['forward_s'] * 1e3:.1f} / {two['backward_s'] * 1e3:.1f}"
        lines.append(
            f"| {r.model} | {r.device} | [{r.layers[0]}, {r.layers[1]}) | {fb} | "
            f"{cell(r.host_one)} | {cell(r.host_two)} | {cell(r.on_device)} | "
            + " | ".join(
                fmt_decision(r.decisions.get(w)) for w in ("one core", "two cores", "device")
            )
            + " |"
        )
    return lines


def fmt_decision(text: str | None) -> str:
    """A decision for a table cell: "split", or "no" and the reason's gist."""
    if text is None:
        return fmt(None)
    if text == "split":
        return "**split**"
    return "no (" + ("not measured" if "not measured" in text else text.split(",")[0][4:]) + ")"
