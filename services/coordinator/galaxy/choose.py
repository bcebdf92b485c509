"""The serving plan the cost model predicts fastest: which devices take part, and in which mode.

Splitting a model only pays when the compute it saves outweighs the ring
traffic and the fixed cost of every ring step; on a slow link or with a small
model one device is faster. So `choose` prices every mode on every ring of the
devices (a subset, in the order given) that fits the memory budgets, the single
devices included, and keeps the cheapest. One device is always a candidate when
it can hold the model, so the plan chosen is never predicted slower than the
best single device.

Pure: profiles, budgets and link figures in, a plan out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from common.errors import AsteroidError, ConfigError, PlanError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.cost import predict
from services.coordinator.galaxy.planner import (
    capacities,
    fits,
    plan_galaxy,
    plan_local,
    plan_megatron,
    plan_sp,
)

__all__ = ["DEFAULT_LINK_BPS", "STEP_LATENCY_S", "Choice", "Link", "choose", "rings"]

DEFAULT_LINK_BPS = 1e9
"""Links assumed when the spec names none: the coordinator's default 125 MB/s."""
STEP_LATENCY_S = 0.002
"""Fixed seconds per ring step beyond the devices' own `step_s` when the spec names none:
what the splits measured on the emulated testbed leave per step beyond the cost model
without it (1.3-4.1 ms, `make bench-galaxy`)."""
SPLIT_MARGIN = 0.1
"""A split must be predicted this much faster than the best single device to be chosen:
the cost model is off by up to about 15 % on the testbed, so a split predicted only a
little faster is about as likely to be slower, and one device has fewer ways to fail."""
EXHAUSTIVE_DEVICES = 6
"""Up to this many devices every subset is priced (63 rings); beyond, only the fastest
`k` devices for each `k` (a ring is as slow as its slowest member)."""


@dataclass(frozen=True)
class Link:
    """What the cost model needs to know of the links between the devices."""

    bandwidth_bps: float
    """Bits per second of each device's link."""
    step_latency_s: float = 0.0
    """Fixed seconds every ring step costs beyond its bytes (wakeups, framing, scheduling)."""


@dataclass(frozen=True)
class Choice:
    """The plan chosen, its predicted seconds, and every candidate priced (for reports)."""

    plan: InferencePlan
    predicted_s: float
    candidates: tuple[tuple[InferencePlan, float], ...]


def rings(devices: Sequence[str], speed: Mapping[str, float]) -> Iterator[list[str]]:
    """The device subsets worth pricing, each in the order `devices` gives them.

    Every non-empty subset for a few devices; beyond `EXHAUSTIVE_DEVICES`, the
    `k` fastest (by `speed`, higher is faster) for each `k`.
    """
    names = list(devices)
    if len(names) <= EXHAUSTIVE_DEVICES:
        for k in range(1, len(names) + 1):
            for subset in combinations(names, k):
                yield list(subset)
        return
    ranked = sorted(names, key=lambda d: (-speed.get(d, 0.0), names.index(d)))
    for k in range(1, len(names) + 1):
        keep = set(ranked[:k])
        yield [d for d in names if d in keep]


def _plans(
    config: TransformerConfig,
    ring: list[str],
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
    seq_len: int,
    overlap: bool,
) -> Iterator[InferencePlan]:
    """Every mode's plan on `ring` that fits the budgets (those that do not are skipped)."""
    if len(ring) == 1:
        try:
            local = plan_local(config, ring, profiles, budgets, seq_len)
        except PlanError:
            return
        yield local
        return
    for mode in ("galaxy", "megatron", "sp"):
        try:
            if mode == "galaxy":
                plan = plan_galaxy(config, ring, profiles, budgets, seq_len, overlap=overlap)
            elif mode == "megatron":
                plan = plan_megatron(config, ring, seq_len, budgets)
            else:
                plan = plan_sp(config, ring, seq_len, budgets)
        except PlanError:
            continue
        if not fits(plan, config, budgets):
            yield plan


def choose(
    config: TransformerConfig,
    devices: Sequence[str],
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
    seq_len: int,
    link: Link,
    *,
    overlap: bool = True,
    margin: float = SPLIT_MARGIN,
) -> Choice:
    """The fitting plan (any mode, any ring of `devices`) with the lowest predicted latency.

    A plan over several devices is chosen over the best single device only when
    predicted at least `margin` (a fraction) faster. Ties go to fewer devices
    (they leave the others free), then to the order tried: local, galaxy,
    megatron, sp.

    Raises:
        ConfigError: If a device lacks a profile or a budget, or no device is given.
        PlanError: If no plan on any subset fits the budgets.

    """
    names = list(devices)
    if not names:
        raise ConfigError("choosing a plan needs at least one device, got none")
    missing = [d for d in names if d not in profiles or d not in budgets]
    if missing:
        raise ConfigError(f"every device needs a profile and a budget; missing for {missing}")
    speed = dict(zip(names, capacities(config, [profiles[d] for d in names]), strict=True))
    priced: list[tuple[InferencePlan, float]] = []
    for ring in rings(names, speed):
        for plan in _plans(config, ring, profiles, budgets, seq_len, overlap):
            try:
                seconds = predict(
                    plan, config, profiles, link.bandwidth_bps, step_latency_s=link.step_latency_s
                ).total_s
            except AsteroidError:
                continue
            priced.append((plan, seconds))
    if not priced:
        raise PlanError(
            f"no plan over any subset of {names} fits their memory budgets "
            f"({', '.join(f'{d} {budgets[d] >> 20} MiB' for d in names)})"
        )
    best = min(priced, key=lambda c: (c[1], len(c[0].devices)))
    alone = [c for c in priced if len(c[0].devices) == 1]
    if alone and len(best[0].devices) > 1:
        single = min(alone, key=lambda c: c[1])
        if best[1] > (1.0 - margin) * single[1]:
            best = single
    return Choice(best[0], best[1], tuple(priced))
