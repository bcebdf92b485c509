"""Model aggregation: FedAvg, FedAsync's staleness weight and its asynchronous merge.

Averages are taken in float64 and cast back, so a weighted mean of float32 weights is
exact to float32 round-off whatever the number of homes.
"""

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from common.errors import ConfigError

__all__ = ["StalenessKind", "async_merge", "fedavg", "staleness_weight"]

StalenessKind = Literal["polynomial", "constant"]


def _check_like(reference: Mapping[str, Tensor], other: Mapping[str, Tensor], i: int) -> None:
    if set(other) != set(reference):
        missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
        raise ConfigError(f"state {i}: keys differ from state 0 (missing {missing}, extra {extra})")
    for key, value in reference.items():
        if other[key].shape != value.shape:
            raise ConfigError(
                f"state {i}: {key} has shape {tuple(other[key].shape)}, "
                f"state 0 has {tuple(value.shape)}"
            )


def fedavg(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """Sample-weighted average ``sum_i w_i x_i / sum_i w_i`` of state dicts.

    Integer tensors (counters such as batch-norm's ``num_batches_tracked``) are not
    averaged: the first state's are kept.

    Raises:
        ConfigError: No states, a weight count or key set that does not match, or
            weights that are negative or sum to zero.

    """
    if not states:
        raise ConfigError("fedavg needs at least one state, got none")
    if len(weights) != len(states):
        raise ConfigError(f"need one weight per state ({len(states)}), got {len(weights)}")
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ConfigError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    first = states[0]
    for i, state in enumerate(states[1:], start=1):
        _check_like(first, state, i)
    total = float(sum(weights))
    out: dict[str, Tensor] = {}
    for key, value in first.items():
        if not value.is_floating_point():
            out[key] = value.clone()
            continue
        acc = torch.zeros(value.shape, dtype=torch.float64)
        for state, weight in zip(states, weights, strict=True):
            acc += state[key].detach().to(torch.float64) * (weight / total)
        out[key] = acc.to(value.dtype)
    return out


def staleness_weight(
    now: int, base: int, kind: StalenessKind = "polynomial", exponent: float = 0.5
) -> float:
    """FedAsync's ``s(t - tau)``: how much an update computed on version ``tau`` counts.

    ``polynomial`` is ``(t - tau + 1) ** -exponent`` (1 when fresh, decaying with age);
    ``constant`` is 1.

    Raises:
        ConfigError: ``base`` newer than ``now``, a negative exponent, or an unknown kind.

    """
    if base > now or base < 0:
        raise ConfigError(f"base version must be in [0, {now}], got {base}")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        if exponent < 0:
            raise ConfigError(f"staleness exponent must be >= 0, got {exponent}")
        return float((now - base + 1) ** -exponent)
    raise ConfigError(f"staleness kind must be 'polynomial' or 'constant', got {kind!r}")


def async_merge(
    global_state: Mapping[str, Tensor], update: Mapping[str, Tensor], alpha: float
) -> dict[str, Tensor]:
    """FedAsync's server step ``w <- (1 - alpha) w + alpha w_new``.

    Raises:
        ConfigError: ``alpha`` outside [0, 1] or states that do not match.

    """
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"mixing weight alpha must be in [0, 1], got {alpha}")
    return fedavg([global_state, update], [1.0 - alpha, alpha])
