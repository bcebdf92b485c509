"""A single-process, seeded, virtual-clock federation of homes training on real digits.

Each group's round starts from the current global model; every member trains the FL
CNN for K real SGD steps on its own Dirichlet split and the round ends, in virtual
time, when its slowest member finishes (a home's latency is its per-round training
time, times the slow-downs in force when the round starts). The strategy then updates
the global model, which is scored on the held-out set, and regroups from the measured
latencies. No threads or clocks: a run is a pure function of its config.
"""

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.fl.data import (
    DIGIT_CLASSES,
    DigitsSplit,
    dirichlet_split,
    label_histogram,
    load_digits_split,
)
from common.zoo import ModelSpec, OptionValue, build_model
from services.federation.grouping import Groups
from services.federation.strategies import FitResult, Strategy

__all__ = [
    "DIGITS_CNN",
    "CurvePoint",
    "RegroupEvent",
    "SimConfig",
    "SimResult",
    "SlowDown",
    "latency_at",
    "local_train",
    "round_seed",
    "simulate",
]

DIGITS_CNN: dict[str, OptionValue] = {"channels": 1, "size": 8, "width": 16, "hidden": 64}
"""The FL CNN sized for 8x8 digits: small enough that a 20-update run takes seconds."""


@dataclass(frozen=True)
class SlowDown:
    """From virtual time ``at`` on, ``home``'s rounds take ``factor`` times longer."""

    home: int
    at: float
    factor: float


@dataclass(frozen=True)
class SimConfig:
    """One simulated federation.

    Attributes:
        round_times: Each home's virtual seconds per local round (its latency).
        slowdowns: Changes of a home's speed over virtual time (they compound).
        dirichlet_alpha: Label skew of the split across homes.
        updates: Global model updates to run.
        local_steps: SGD steps per home per round (K).
        batch_size: Mini-batch size of local SGD.
        lr: Learning rate of local SGD.
        seed: Seeds the data split, the model and every home's mini-batches.
        min_size: Fewest training samples any home gets.
        model_options: Options of the ``fl_cnn`` model.

    """

    round_times: tuple[float, ...]
    slowdowns: tuple[SlowDown, ...] = ()
    dirichlet_alpha: float = 1.0
    updates: int = 20
    local_steps: int = 10
    batch_size: int = 32
    lr: float = 0.2
    seed: int = 0
    min_size: int = 10
    model_options: Mapping[str, OptionValue] = field(default_factory=lambda: dict(DIGITS_CNN))

    def __post_init__(self) -> None:
        n = len(self.round_times)
        if n < 1 or any(not t > 0 for t in self.round_times):
            raise ConfigError(f"need >= 1 home with round times > 0, got {self.round_times}")
        for s in self.slowdowns:
            if not 0 <= s.home < n or not s.factor > 0 or s.at < 0:
                raise ConfigError(f"slow-down needs home in [0, {n}), factor > 0, at >= 0; got {s}")
        if min(self.updates, self.local_steps, self.batch_size) < 1 or not self.lr > 0:
            raise ConfigError(
                "updates, local_steps, batch_size must be >= 1 and lr > 0, got "
                f"{self.updates}, {self.local_steps}, {self.batch_size}, {self.lr}"
            )


@dataclass(frozen=True)
class CurvePoint:
    """Held-out accuracy of global model ``version`` at virtual ``time``."""

    time: float
    version: int
    accuracy: float


@dataclass(frozen=True)
class RegroupEvent:
    """A home that moved, dropped out or rejoined (``group`` None when out)."""

    time: float
    home: int
    action: str
    group: int | None


@dataclass(frozen=True)
class SimResult:
    """Accuracy curve, regrouping log, groupings and the final global model."""

    strategy: str
    curve: tuple[CurvePoint, ...]
    events: tuple[RegroupEvent, ...]
    initial_groups: Groups
    final_groups: Groups
    final_state: dict[str, Tensor]


@dataclass(frozen=True)
class _Round:
    members: tuple[int, ...]
    latencies: tuple[float, ...]
    base_state: dict[str, Tensor]
    base_version: int


def latency_at(config: SimConfig, home: int, time: float) -> float:
    """The home's round time for a round starting at ``time``, slow-downs applied."""
    factors = [s.factor for s in config.slowdowns if s.home == home and s.at <= time]
    return config.round_times[home] * math.prod(factors)


def round_seed(seed: int, home: int, round_no: int) -> int:
    """Seed of a home's mini-batch draws in its ``round_no``-th round."""
    return seed * 1_000_003 + home * 10_007 + round_no


def local_train(
    model: nn.Module,
    state: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    config: SimConfig,
    generator: torch.Generator,
) -> dict[str, Tensor]:
    """Plain SGD (no momentum, so no optimiser state to federate) for ``local_steps`` batches."""
    model.load_state_dict(state)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = min(config.batch_size, len(y))
    for _ in range(config.local_steps):
        idx = torch.randperm(len(y), generator=generator)[:batch]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(g, alpha=config.lr)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _accuracy(model: nn.Module, state: Mapping[str, Tensor], x: Tensor, y: Tensor) -> float:
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def simulate(strategy: Strategy, config: SimConfig, data: DigitsSplit | None = None) -> SimResult:
    """Run the federation until ``config.updates`` global updates; see the module doc.

    Raises:
        ConfigError: A bad config, or a split that leaves a home too few samples.

    """
    data = data if data is not None else load_digits_split(seed=config.seed)
    homes = len(config.round_times)
    parts = dirichlet_split(
        data.train_y, homes, config.dirichlet_alpha, config.seed, config.min_size
    )
    spec = ModelSpec(name="fl_cnn", num_classes=DIGIT_CLASSES, options=dict(config.model_options))
    model = build_model(spec, seed=config.seed).full()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    groups = strategy.start(
        [latency_at(config, h, 0.0) for h in range(homes)],
        [label_histogram(data.train_y[p], DIGIT_CLASSES) for p in parts],
    )
    initial = groups.groups
    version, rounds_done = 0, [0] * homes
    curve = [CurvePoint(0.0, 0, _accuracy(model, state, data.test_x, data.test_y))]
    events: list[RegroupEvent] = []
    running: dict[int, _Round] = {}
    queue: list[tuple[float, int]] = []

    def launch(now: float) -> None:
        for g, members in enumerate(groups.groups):
            if g in running or not members:
                continue
            lats = tuple(latency_at(config, h, now) for h in members)
            running[g] = _Round(members, lats, state, version)
            heapq.heappush(queue, (now + max(lats), g))

    launch(0.0)
    while version < config.updates and queue:
        now, g = heapq.heappop(queue)
        rnd = running.pop(g)
        results = []
        for h in rnd.members:
            gen = torch.Generator().manual_seed(round_seed(config.seed, h, rounds_done[h]))
            rounds_done[h] += 1
            x, y = data.train_x[parts[h]], data.train_y[parts[h]]
            trained = local_train(model, rnd.base_state, x, y, config, gen)
            results.append(FitResult(h, trained, len(parts[h]), rnd.base_version))
        results, _ = strategy.screen(rnd.base_state, results)
        state = strategy.aggregate_fit(state, version, results, [])
        version += 1
        curve.append(CurvePoint(now, version, _accuracy(model, state, data.test_x, data.test_y)))
        measured = list(zip(rnd.members, rnd.latencies, strict=True))
        measured += [(h, latency_at(config, h, now)) for h in sorted(groups.dropped)]
        for h, lat in measured:
            outcome = strategy.observe(groups, h, lat)
            groups = outcome.state
            if outcome.action not in ("stay", "out"):
                events.append(RegroupEvent(now, h, outcome.action, outcome.group))
        launch(now)
    return SimResult(strategy.name, tuple(curve), tuple(events), initial, groups.groups, state)
