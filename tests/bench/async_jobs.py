"""bench_async's jobs and plans: what each compared run trains, on which stages.

Every run of a part has the same plan, seed, data and optimizer; only the
mode and the window (micro-batches per round) differ, so that a ratio of two
runs is the mode's doing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 1, "size": 8, "width": 16, "hidden": 64},
}
LAYERS = 4
"""fl_cnn's layers: conv block, conv block, hidden linear, classifier."""
DATA: dict[str, Any] = {"kind": "digits", "homes": 1, "home": 0, "alpha": 1.0}
LR = 0.1
"""Plain SGD (no momentum) at this learning rate in every compared mode: sync takes one
step of the window's mean gradient per round, async one step per micro-batch. In
single-process replays (`tests.reference`) of this job async alone stays stable up to
about this rate (at 0.2 it diverges, at 0.05 it learns more slowly)."""
MICRO = 8
WINDOWS = (4, 16, 64)
"""Part 1's windows: micro-batches per round at the same micro-batch size."""
ACC_WINDOW = 16
"""Part 3's window: longer than K_0 = 2S - 1 = 7, so that forwards run on stale versions
(with a window of K_0 or fewer micro-batches every forward of a window runs on its first
version, and async is sync with the learning rate times M)."""
SEED = 1
TARGET = 0.9
EVAL_EVERY = 5
AGGREGATE_K0_MULTIPLE = 1
"""aggregate_every = this times K_0 (FTPipeHD: a multiple of the concurrent versions);
updates are counted per window, so it stays at most the window."""
HEAVY_MODEL: dict[str, Any] = {
    "name": "fl_cnn",
    "num_classes": 10,
    "options": {"channels": 3, "size": 32, "width": 32, "hidden": 64},
}
"""Part 1's heavy-layer set: the same four layers at CIFAR's size (3x32x32 images, FedAvg's
width of 32 and 64 channels), the regime of PipeDream and FTPipeHD: a conv layer's forward
and backward per micro-batch (about 12 ms for the second conv at micro-batch 8 on one host
core, some 25 ms on the TX2-like device's half core) is large against its 51 k parameters,
whose step and snapshot take well under a millisecond. The hidden layer stays narrow (64,
not FedAvg's 512): at 512 it holds 2.1 M parameters, whose per-micro-batch update on a
Nano-like quota would be a layer whose update, not its compute, is what costs."""
HEAVY_DATA: dict[str, Any] = {"kind": "synthetic"}
"""Synthetic images of the model's input shape (`common.data.SyntheticImages`): the
throughput runs do not evaluate, and digits are 8x8."""
HEAVY_WINDOWS = (4, 16)
"""The heavy set's windows: sync's bubble is largest at small M."""
STAGE_DEVICES = ("nano-0", "tx2-0", "nano-1", "nano-2")
"""Stage i (layer i) runs on STAGE_DEVICES[i] in the light set: the second conv block,
by far its heaviest layer, on the fastest device."""
HEAVY_STAGE_DEVICES = STAGE_DEVICES
"""The heavy set's plan: the light set's, the second conv on the TX2. Measured on the
testbed (sync, M 4 and 16), its bottleneck is the first conv on a Nano's quota, about 22 ms
a micro-batch (three input channels at 32x32: the slowest layer per operation), the second
conv 6.5 ms on the TX2; with the two swapped, the second conv on a Nano took 20-33 ms and
sync ran at 210 samples/s instead of 270-330."""

BALANCED_MODEL: dict[str, Any] = {
    "name": "mobilenet_v2",
    "num_classes": 10,
    "options": {"width_mult": 0.5},
}
"""Part 1's balanced set: 20 layers of convolutions (about 0.7 M parameters, some 100-200 ms
of forward and backward per micro-batch of 3x32x32 on one host core), cut by cost so that
every stage takes about as long on its device: sync's bubble is then fill and drain, not
one slow stage, and each micro-batch's update (about a millisecond) is small against a
stage's compute. PipeDream's and FTPipeHD's setting: more layers than stages, balanced."""
BALANCED_LAYERS = 20
BALANCED_DATA: dict[str, Any] = {"kind": "synthetic"}
BALANCED_WINDOWS = (4, 16)

HETERO_MODEL: dict[str, Any] = {
    "name": "mlp",
    "num_classes": 10,
    "options": {"hidden": 256, "depth": 7},
}
"""Part 2's model: an mlp of eight layers (seven Linear+ReLU and the classifier),
so that partition points have room to move between four stages."""
HETERO_LAYERS = 8
HETERO_DATA: dict[str, Any] = {"kind": "synthetic"}
HETERO_WINDOW = 8
HETERO_DEVICES = ("tx2-0", "nano-0", "nano-1", "nano-2")
HETERO_CUT = 1 / 3
"""The throttled device keeps this share of its CPU quota (a thermal throttle)."""
BALANCED_DEVICES = HETERO_DEVICES
"""The balanced set's stage order: the TX2-like device, with the most work, first."""


@dataclass(frozen=True)
class Config:
    """One way of training a plan."""

    name: str
    mode: str
    microbatches: int
    aggregate_every: int = 0
    lr_scale: int = 1

    @property
    def global_batch(self) -> int:
        return MICRO * self.microbatches

    @property
    def lr(self) -> float:
        return LR * self.lr_scale


def k0(devices: int, microbatches: int) -> int:
    """K_0: the first stage's warm-up forwards (Asteroid's 2S-1, never above M)."""
    return max(1, min(2 * devices - 1, microbatches))


def throughput_configs(windows: Sequence[int] = WINDOWS, prefix: str = "") -> list[Config]:
    """Part 1's configurations: sync and async at each window (names start with `prefix`)."""
    return [Config(f"{prefix}{mode} M={m}", mode, m) for m in windows for mode in ("sync", "async")]


def hetero_configs() -> list[Config]:
    """Part 2's configurations: sync and async on the heterogeneous pipeline."""
    return [Config(f"{mode} hetero", mode, HETERO_WINDOW) for mode in ("sync", "async")]


def accuracy_configs(stages: int = LAYERS) -> list[Config]:
    """Part 3's configurations over windows of `ACC_WINDOW` micro-batches: sync, async,
    async with aggregation every `AGGREGATE_K0_MULTIPLE` K_0 updates, all at `LR`; then,
    for reference only (not one of the compared curves), sync at M times `LR`: the step
    that the window's M async updates add up to."""
    agg = AGGREGATE_K0_MULTIPLE * k0(stages, ACC_WINDOW)
    return [
        Config("sync", "sync", ACC_WINDOW),
        Config("async", "async", ACC_WINDOW),
        Config("async+agg", "async", ACC_WINDOW, agg),
        Config(f"sync, lr x{ACC_WINDOW}", "sync", ACC_WINDOW, lr_scale=ACC_WINDOW),
    ]


def plan_for(devices: Sequence[str], microbatches: int, layers: int = LAYERS) -> dict[str, Any]:
    """One single-device stage per device, in `devices`' order, the layers split evenly
    (one fl_cnn layer each with four devices)."""
    if not 1 <= len(devices) <= layers:
        raise ValueError(f"the model has {layers} layers: give 1 to {layers} devices")
    cuts = [round(i * layers / len(devices)) for i in range(len(devices) + 1)]
    return plan_of(devices, cuts, microbatches)


def plan_of(devices: Sequence[str], cuts: Sequence[int], microbatches: int) -> dict[str, Any]:
    """Stage i runs layers [cuts[i], cuts[i+1]) on devices[i] alone."""
    return {
        "global_batch": MICRO * microbatches,
        "microbatches": microbatches,
        "planner": "manual",
        "stages": [
            {"start": cuts[i], "end": cuts[i + 1], "devices": [{"device": d, "share": 1}]}
            for i, d in enumerate(devices)
        ],
    }


def cuts_by_speed(
    layer_costs: Sequence[float],
    speeds: Mapping[str, float],
    devices: Sequence[str] = HETERO_DEVICES,
) -> list[int]:
    """Partition points for single-device stages on `devices` in order, the layers
    balanced by the devices' speeds.

    The same split a re-partition makes (`survivors_plan`, by capacity), so that a
    run starts on the plan the devices' profiles and quotas call for.
    """
    from common.ids import DeviceId
    from common.plan import Plan
    from services.coordinator.recovery import survivors_plan

    even = Plan.model_validate(plan_for(devices, 1, len(layer_costs)))
    by_device = {DeviceId(d): s for d, s in speeds.items()}
    balanced = survivors_plan(even, set(), layer_costs, by_device)
    return [balanced.stages[0].start, *(st.end for st in balanced.stages)]


def job_for(
    cfg: Config,
    job_id: str,
    rounds: int,
    eval_every: int = 0,
    *,
    model: Mapping[str, Any] = MODEL,
    data: Mapping[str, Any] = DATA,
    adapt: bool = False,
) -> dict[str, Any]:
    """The job of one run: everything but the mode and the window is the same in a part."""
    job: dict[str, Any] = {
        "job_id": job_id,
        "model": dict(model),
        "dataset": dict(data),
        "seed": SEED,
        "rounds": rounds,
        "global_batch": cfg.global_batch,
        "micro_batch": MICRO,
        "optimizer": {"kind": "sgd", "lr": cfg.lr, "momentum": 0.0},
        "mode": cfg.mode,
        "eval_every": eval_every,
        "elastic": False,
        "adapt": adapt,  # parts 1 and 3: the plan stays the one given
        "replicate_every": 0,
    }
    if cfg.aggregate_every:
        job["aggregate_every"] = cfg.aggregate_every
    return job
