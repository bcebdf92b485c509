"""The split gain a device's profile carries: Duan & Wu's split measured where profiles are made.

The planner splits a device only where its profile says the split pays
(`Profile.split_gain` above the planner's margin), so the profiler measures
it: on a device with two usable cores or more (this process's affinity), one
forward+backward pair in turn at the best unsplit thread count against the
pair on two pinned lanes (`services.lib.split_gain`). A device with one core,
or whose CPU quota is below two cores (an emulated device's cgroup, a
container's `--cpus`), gets no gain, so it is never split: its lanes could
only time-slice what it has, and measuring that would slow its profile for
nothing.

One range stands for the model: the heaviest run of `ceil(layers / STAGES)`
consecutive layers (forward + backward at the profiled batch size nearest
`MICRO`), about a stage of a depth-`STAGES` pipeline at its micro-batch.
Measuring every range the planner might consider would cost more than the
profile itself; the heaviest is where the split matters most to a round.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection

from common.accelerator import AcceleratorInfo
from common.device import cpu_quota
from common.logging import get_logger
from common.profile import Profile
from common.zoo import ModelSpec
from services.lib.split_gain import layer_range, measure_split_gain, with_split_gain

__all__ = ["MICRO", "STAGES", "heaviest_range", "with_device_split_gain"]

log = get_logger(__name__)
STAGES = 4
"""Pipeline depth whose stage size the measured range has (the papers' depth 4)."""
MICRO = 16
"""Micro-batch size the range is measured at: the profiled batch size nearest it."""
REPEATS = 5
"""Timed pairs per way (medians, taken in turns)."""


def heaviest_range(profile: Profile, micro: int = MICRO, stages: int = STAGES) -> tuple[int, int]:
    """The run of ceil(layers / stages) layers with the most forward + backward time."""
    col = min(range(len(profile.batch_sizes)), key=lambda j: abs(profile.batch_sizes[j] - micro))
    cost = [layer.forward_s[col] + layer.backward_s[col] for layer in profile.layers]
    width = math.ceil(len(cost) / max(1, stages))
    lo = max(range(len(cost) - width + 1), key=lambda i: sum(cost[i : i + width]))
    return lo, lo + width


def with_device_split_gain(
    profile: Profile,
    spec: ModelSpec,
    allowed_modules: Collection[str] = (),
    seed: int = 0,
    cores: Collection[int] | None = None,
    accelerator: AcceleratorInfo | None = None,
) -> Profile:
    """`profile` with the split gain measured on this device's cores (unchanged on one core).

    `cores` None: this process's affinity, and its cgroup CPU quota must
    allow two cores too. The lanes divide CPU cores, so a profile made on a
    GPU (`accelerator` of kind cuda) gets no gain either.
    """
    have = frozenset(os.sched_getaffinity(0) if cores is None else cores)
    quota = cpu_quota() if cores is None else None
    if len(have) < 2 or (quota is not None and quota < 2):
        return profile
    if accelerator is not None and accelerator.kind != "cpu":
        return profile
    lo, hi = heaviest_range(profile)
    col = min(profile.batch_sizes, key=lambda b: abs(b - MICRO))
    module, x = layer_range(spec, lo, hi, col, seed, allowed_modules)
    got = measure_split_gain(module, x, repeats=REPEATS, cores=have)
    log.info(
        "split gain measured",
        model=profile.model,
        layers=[lo, hi],
        micro=col,
        cores=len(have),
        gain=round(got.gain, 4),
        best_threads=got.best_threads,
    )
    return with_split_gain(profile, max(-1.0, got.gain))
