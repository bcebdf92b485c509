"""How a decoder picks its next token from a row of logits: greedy, or seeded sampling.

Every device of a serving ring holds the same logits, bit for bit (`hmp.run`
gathers the final rows everywhere), and each picks the next token on its own,
without another message. So a sample must be a pure function of the logits,
the request's seed and the step: the draw comes from a private
`torch.Generator` seeded with both (never the global RNG), the nucleus is cut
after a stable sort (ties keep the lower token id first) and the token is
found by inverting the cumulative distribution in float64 on the CPU. The same
logits then give the same token on every device, in every process and on any
accelerator.

`finish_reason` names why generation ended as OpenAI's API does: a stop token
was produced (`stop`; the stop token itself is left out of the output, as
OpenAI leaves the stop sequence out of the text) or `max_tokens` were
generated (`length`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from common.errors import ConfigError
from common.serving_messages import MAX_TEMPERATURE

__all__ = [
    "GREEDY",
    "MAX_TEMPERATURE",
    "Finish",
    "Sampler",
    "finish_reason",
    "nucleus",
    "uniform",
]

_SEED_MIX = 1_000_003
"""Spreads (seed, step) pairs over the generator's seeds without collisions for small steps."""

Finish = Literal["stop", "length"]
"""Why generation ended: a stop token came, or the token budget was spent."""


def uniform(seed: int, step: int) -> float:
    """The uniform draw in [0, 1) of decoding step `step` of a request seeded `seed`.

    Its own generator per step: a device that joins a request late (a re-run
    after a device loss) draws what the others drew at that step.
    """
    gen = torch.Generator().manual_seed((seed * _SEED_MIX + step) % 2**63)
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def nucleus(logits: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """The tokens of the top-p nucleus, most probable first, and their renormalised probabilities.

    softmax(logits / temperature) in float64, sorted stably (equal probabilities
    keep the lower id first); the nucleus is the shortest prefix whose mass
    reaches `top_p` (all tokens at `top_p == 1`).
    """
    probs = torch.softmax(logits.detach().to("cpu", torch.float64) / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    if top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = int((before < top_p).sum())  # the mass before a kept token is below top_p
        sorted_probs, order = sorted_probs[:keep], order[:keep]
    return order, sorted_probs / sorted_probs.sum()


@dataclass(frozen=True)
class Sampler:
    """Picks a token from a logits row: greedy at temperature 0, else seeded top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse what has no meaning: a negative or huge temperature, top_p outside (0, 1]."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ConfigError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token (the lowest id among equals)."""
        return self.temperature == 0.0

    def __call__(self, logits: Tensor, step: int) -> int:
        """The token of decoding step `step` (0 for the first generated token) from `logits`.

        Raises:
            ConfigError: If `logits` is not one row.

        """
        if logits.dim() != 1 or logits.shape[0] < 1:
            raise ConfigError(f"a sampler takes one row of logits, got {tuple(logits.shape)}")
        if self.greedy:
            return int(logits.argmax())
        order, probs = nucleus(logits, self.temperature, self.top_p)
        cdf = torch.cumsum(probs, dim=-1)
        at = torch.tensor([uniform(self.seed, step)], dtype=torch.float64)
        index = min(int(torch.searchsorted(cdf, at, right=True)), len(order) - 1)
        return int(order[index])


GREEDY = Sampler()
"""Greedy decoding, as `transformers`' `generate` without sampling."""


def finish_reason(tokens: Collection[int], new_tokens: int) -> Finish:
    """Why a generation of `tokens` (stop token left out) out of `new_tokens` asked ended.

    Only a stop token ends a generation early (and is left out of `tokens`);
    one of exactly `new_tokens` tokens spent its budget.
    """
    return "stop" if len(tokens) < new_tokens else "length"
