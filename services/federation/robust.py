"""Robust aggregation: screening homes' updates before they are averaged, and robust means.

FedAvg trusts every home twice: its sample count is its weight, and its model enters
the mean as it is. One home that claims 2^40 samples, or sends weights of 3e38, then
*is* the global model. The screen measures each update against the others (and the
updates taken before), never against a fixed scale, so that an honest federation is
untouched:

- a non-finite update is rejected; so is one whose sample count exceeds the configured
  maximum;
- the update's delta from the model the home trained from, ``||x_i - g||`` over all
  floating tensors, is compared with the lower median ``m`` of the deltas of this
  round (of the recent rounds' too, when the round has a single update): above
  ``reject_norm * m`` it is rejected, above ``clip_norm * m`` it is scaled back onto
  that radius;
- a sample count above ``sample_clip`` times the lower median count (of this round and
  the recent ones) is cut down to it.

The lower median of n values is the ``(n - 1) // 2``-th smallest: with two homes it is
the smaller one, so one hostile home never sets its own yardstick. With a single
update and no history there is nothing to compare with, and nothing is screened.

After the screen, a group's models are combined by the sample-weighted mean (FedAvg,
exact), or by the coordinate-wise trimmed mean or median, which ignore sample counts
and bound what any minority of homes can do to a coordinate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from common.errors import ConfigError
from common.fl.spec import CombineRule, RobustAggregation
from services.federation.aggregate import fedavg

__all__ = [
    "Screen",
    "Screened",
    "Update",
    "clip_delta",
    "combine",
    "coordinate_median",
    "delta_norm",
    "is_finite",
    "lower_median",
    "trimmed_mean",
]


@dataclass(frozen=True)
class Screened:
    """A home whose update the screen changed: ``clipped`` or ``rejected``, and why."""

    home: int
    action: Literal["clipped", "rejected"]
    reason: str


def lower_median(values: Sequence[float]) -> float:
    """The ``(n - 1) // 2``-th smallest value (nan for no values)."""
    if not values:
        return math.nan
    return sorted(values)[(len(values) - 1) // 2]


def is_finite(state: Mapping[str, Tensor]) -> bool:
    """True when every floating tensor of `state` holds only finite values."""
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def delta_norm(state: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> float:
    """``||state - reference||_2`` over all floating tensors, in float64."""
    total = 0.0
    for key, ref in reference.items():
        if ref.is_floating_point():
            diff = state[key].detach().to(torch.float64) - ref.detach().to(torch.float64)
            total += float(diff.pow(2).sum())
    return math.sqrt(total)


def clip_delta(
    state: Mapping[str, Tensor], reference: Mapping[str, Tensor], radius: float
) -> dict[str, Tensor]:
    """`state` moved onto the ball of `radius` around `reference` if it lies outside.

    Floating tensors become ``reference + (state - reference) * radius / norm``;
    others are kept. Inside the ball, `state` comes back unchanged (same values).
    """
    norm = delta_norm(state, reference)
    if norm <= radius:
        return dict(state)
    scale = radius / norm
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        ref = reference[key]
        if not ref.is_floating_point():
            out[key] = value
            continue
        base = ref.detach().to(torch.float64)
        moved = base + (value.detach().to(torch.float64) - base) * scale
        out[key] = moved.to(ref.dtype)
    return out


def _stack(states: Sequence[Mapping[str, Tensor]], key: str) -> Tensor:
    return torch.stack([s[key].detach().to(torch.float64) for s in states])


def trimmed_mean(states: Sequence[Mapping[str, Tensor]], trim: float) -> dict[str, Tensor]:
    """Coordinate-wise mean after dropping the ``floor(trim * n)`` lowest and highest values.

    Integer tensors are the first state's, as in `fedavg`.

    Raises:
        ConfigError: No states, or ``trim`` outside [0, 0.5).

    """
    if not states:
        raise ConfigError("trimmed_mean needs at least one state, got none")
    if not 0.0 <= trim < 0.5:
        raise ConfigError(f"trim must be in [0, 0.5), got {trim}")
    return _middle_mean(states, math.floor(trim * len(states)))


def coordinate_median(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Coordinate-wise median (the mean of the middle two for an even count).

    Raises:
        ConfigError: No states.

    """
    if not states:
        raise ConfigError("coordinate_median needs at least one state, got none")
    # the middle one of an odd count, the middle two of an even one
    return _middle_mean(states, (len(states) - 1) // 2)


def _middle_mean(states: Sequence[Mapping[str, Tensor]], cut: int) -> dict[str, Tensor]:
    """Per coordinate, the mean of the values left after the `cut` lowest and highest.

    Integer tensors are the first state's, as in `fedavg`.
    """
    out: dict[str, Tensor] = {}
    for key, value in states[0].items():
        if not value.is_floating_point():
            out[key] = value.clone()
            continue
        ranked = _stack(states, key).sort(dim=0).values
        out[key] = ranked[cut : len(states) - cut].mean(dim=0).to(value.dtype)
    return out


def combine(
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    rule: CombineRule,
    trim: float = 0.2,
) -> dict[str, Tensor]:
    """A group's model from its members' by `rule` (``mean`` is `fedavg`, exactly)."""
    if rule == "mean":
        return fedavg(states, weights)
    if rule == "trimmed_mean":
        return trimmed_mean(states, trim)
    if rule == "median":
        return coordinate_median(states)
    raise ConfigError(f"combine rule must be mean, trimmed_mean or median, got {rule!r}")


@dataclass(frozen=True)
class Update:
    """One home's model and sample count, as the screen sees it."""

    home: int
    state: Mapping[str, Tensor]
    num_samples: int


class Screen:
    """The screen of the module doc; it remembers the deltas and counts it took.

    Kept by a strategy for the life of a federation (a restart starts it empty).
    """

    def __init__(self, config: RobustAggregation) -> None:
        self.config = config
        self.norms: deque[float] = deque(maxlen=config.history)
        self.samples: deque[int] = deque(maxlen=config.history)

    def __call__(
        self, reference: Mapping[str, Tensor], updates: Sequence[Update]
    ) -> tuple[list[Update], tuple[Screened, ...]]:
        """The updates to aggregate (some clipped) and what was done to which home."""
        cfg = self.config
        events: list[Screened] = []
        sound: list[tuple[Update, float]] = []
        for u in updates:
            if not is_finite(u.state):
                events.append(Screened(u.home, "rejected", "its model holds non-finite values"))
            elif u.num_samples > cfg.max_samples:
                events.append(
                    Screened(
                        u.home,
                        "rejected",
                        f"{u.num_samples} samples, the most a home may claim is {cfg.max_samples}",
                    )
                )
            else:
                sound.append((u, delta_norm(u.state, reference)))
        current = [n for _, n in sound]
        yardstick = lower_median(current if len(current) > 1 else current + list(self.norms))
        kept: list[tuple[Update, float]] = []
        for u, norm in sound:
            if yardstick > 0 and cfg.reject_norm is not None and norm > cfg.reject_norm * yardstick:
                events.append(
                    Screened(
                        u.home,
                        "rejected",
                        f"its update's norm {norm:.3g} is over {cfg.reject_norm:g} x the median "
                        f"{yardstick:.3g}",
                    )
                )
                continue
            if yardstick > 0 and cfg.clip_norm is not None and norm > cfg.clip_norm * yardstick:
                radius = cfg.clip_norm * yardstick
                events.append(
                    Screened(
                        u.home,
                        "clipped",
                        f"its update's norm {norm:.3g} clipped to {cfg.clip_norm:g} x the median "
                        f"{yardstick:.3g}",
                    )
                )
                u, norm = (
                    Update(u.home, clip_delta(u.state, reference, radius), u.num_samples),
                    radius,
                )
            kept.append((u, norm))
        counts = [float(u.num_samples) for u, _ in kept] + [float(s) for s in self.samples]
        typical = lower_median(counts)
        out: list[Update] = []
        for u, norm in kept:
            if cfg.sample_clip is not None and u.num_samples > cfg.sample_clip * typical:
                cap = max(1, int(cfg.sample_clip * typical))
                events.append(
                    Screened(
                        u.home,
                        "clipped",
                        f"its {u.num_samples} samples counted as {cap} ({cfg.sample_clip:g} x the "
                        f"median {typical:g})",
                    )
                )
                u = Update(u.home, u.state, cap)
            out.append(u)
            self.norms.append(norm)
            self.samples.append(u.num_samples)
        return out, tuple(events)
