"""The five federation strategies behind one small interface, selected by name.

As in Flower's ``Strategy``, the server hands a strategy the results and failures of
a round and the strategy decides the new global model; here a "round" is one group's
synchronous round, and groups run asynchronously of each other. FedAvg is the case of
one group of all homes, FedAsync that of one group per home.
"""

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from torch import Tensor

from common.errors import ConfigError
from common.fl.spec import FederationSpec, RobustAggregation
from services.federation.aggregate import StalenessKind, async_merge, staleness_weight
from services.federation.band import check_band
from services.federation.grouping import (
    Groups,
    GroupState,
    Regrouped,
    astraea_groups,
    fedat_groups,
    group_homes,
    record,
    regroup,
)
from services.federation.robust import Screen, Screened, Update, combine

__all__ = [
    "STRATEGIES",
    "Astraea",
    "EcoFL",
    "FedAT",
    "FedAsync",
    "FedAvg",
    "FitResult",
    "Strategy",
    "make_strategy",
    "strategy_for",
]


@dataclass(frozen=True)
class FitResult:
    """One home's local training result.

    Attributes:
        home: The home's id.
        state: Its model after local training.
        num_samples: Its training-set size, FedAvg's weight.
        base_version: Version of the global model it started from (for staleness).

    """

    home: int
    state: Mapping[str, Tensor]
    num_samples: int
    base_version: int


class Strategy(ABC):
    """Groups homes, aggregates a group's round into the global model, regroups.

    The default aggregation is Eco-FL's: FedAvg inside the group, then an asynchronous
    merge into the global model with mixing weight ``alpha * s(t - tau)``. `robust`
    says how updates are screened (`screen`) and how a group's models are combined
    (see `services.federation.robust`); its defaults leave an honest federation's FedAvg exact.
    ``window`` and ``dwell`` make the regrouping band robust to timing noise
    (`services.federation.band`); 1 and 1, the defaults here, are Algorithm 1 as published.
    """

    name: ClassVar[str]
    drops_homes: ClassVar[bool] = False
    """True where `observe` may drop a home that no group's band holds (Algorithm 1)."""

    def __init__(
        self,
        groups: int = 2,
        alpha: float = 0.6,
        staleness: StalenessKind = "polynomial",
        exponent: float = 0.5,
        rt_fraction: float = 0.5,
        latency_weight: float = 1.0,
        robust: RobustAggregation | None = None,
        window: int = 1,
        dwell: int = 1,
    ) -> None:
        if groups < 1 or not 0.0 < alpha <= 1.0:
            raise ConfigError(f"need groups >= 1 and alpha in (0, 1], got {groups} and {alpha}")
        check_band(window, dwell)
        self.window = window
        self.dwell = dwell
        self.groups = groups
        self.alpha = alpha
        self.staleness: StalenessKind = staleness
        self.exponent = exponent
        self.rt_fraction = rt_fraction
        self.latency_weight = latency_weight
        self.robust = robust if robust is not None else RobustAggregation()
        self._screen = Screen(self.robust)

    @abstractmethod
    def initial_groups(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> Groups:
        """The grouping the federation starts with."""

    def start(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> GroupState:
        """The server's initial state from the homes' first latencies and histograms."""
        return GroupState(
            groups=self.initial_groups(latencies, histograms),
            latencies=tuple(float(x) for x in latencies),
            histograms=tuple(tuple(float(c) for c in h) for h in histograms),
            rt_fraction=self.rt_fraction,
            latency_weight=self.latency_weight,
            window=self.window,
            dwell=self.dwell,
        )

    def screen(
        self, base_state: Mapping[str, Tensor], results: Sequence[FitResult]
    ) -> tuple[list[FitResult], tuple[Screened, ...]]:
        """The results to aggregate, some clipped, and which home was clipped or rejected.

        `base_state` is the model the round's homes trained from: a delta is measured
        (and clipped) from it. Call it once per round, before `aggregate_fit`: it
        remembers what it took.
        """
        by_home = {r.home: r for r in results}
        kept, events = self._screen(
            base_state, [Update(r.home, r.state, r.num_samples) for r in results]
        )
        out = [replace(by_home[u.home], state=u.state, num_samples=u.num_samples) for u in kept]
        return out, events

    def group_model(self, results: Sequence[FitResult]) -> dict[str, Tensor]:
        """The results combined by the configured rule (FedAvg by default)."""
        return combine(
            [r.state for r in results],
            [r.num_samples for r in results],
            self.robust.combine,
            self.robust.trim,
        )

    def aggregate_fit(
        self,
        global_state: Mapping[str, Tensor],
        version: int,
        results: Sequence[FitResult],
        failures: Sequence[int],
    ) -> dict[str, Tensor]:
        """New global model after a group's round; failed homes simply do not count."""
        if not results:
            return {k: v.clone() for k, v in global_state.items()}
        group_model = self.group_model(results)
        base = min(r.base_version for r in results)
        weight = self.alpha * staleness_weight(version, base, self.staleness, self.exponent)
        return async_merge(global_state, group_model, weight)

    def observe(self, state: GroupState, home: int, latency: float) -> Regrouped:
        """Record a measured latency; static strategies never regroup."""
        return Regrouped(record(state, home, latency), "stay", state.group_of(home))


class FedAvg(Strategy):
    """All homes in one synchronous round; the sample-weighted average replaces the model."""

    name = "fedavg"

    def initial_groups(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> Groups:
        """One group of every home."""
        return (tuple(range(len(latencies))),)

    def aggregate_fit(
        self,
        global_state: Mapping[str, Tensor],
        version: int,
        results: Sequence[FitResult],
        failures: Sequence[int],
    ) -> dict[str, Tensor]:
        """Replace the global model by the average (synchronous, nothing is stale)."""
        if not results:
            return {k: v.clone() for k, v in global_state.items()}
        return self.group_model(results)


class FedAsync(Strategy):
    """Every home on its own: each update is merged with a staleness-decayed weight."""

    name = "fedasync"

    def initial_groups(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> Groups:
        """One group per home (``groups`` is ignored)."""
        return tuple((h,) for h in range(len(latencies)))


class FedAT(Strategy):
    """Latency tiers: synchronous inside a tier, asynchronous across tiers."""

    name = "fedat"

    def initial_groups(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> Groups:
        """FedAT's tiers by response latency."""
        return fedat_groups(latencies, self.groups)


class Astraea(Strategy):
    """Data-balanced groups (latency ignored): synchronous inside, asynchronous across."""

    name = "astraea"

    def initial_groups(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> Groups:
        """Astraea-style greedy groups whose label mix is closest to the federation's."""
        return astraea_groups(histograms, self.groups)


class EcoFL(Strategy):
    """Joint latency-and-data groups, regrouped at run time by Algorithm 1."""

    name = "ecofl"
    drops_homes = True

    def initial_groups(
        self, latencies: Sequence[float], histograms: Sequence[Sequence[float]]
    ) -> Groups:
        """Latency tiers refined toward IID groups."""
        return group_homes(
            latencies, histograms, self.groups, self.latency_weight, self.rt_fraction
        )

    def observe(self, state: GroupState, home: int, latency: float) -> Regrouped:
        """Algorithm 1: move or drop a home whose latency left its group's band."""
        return regroup(state, home, latency)


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedAsync, FedAT, Astraea, EcoFL)
}


def make_strategy(
    name: str,
    groups: int = 2,
    alpha: float = 0.6,
    staleness: StalenessKind = "polynomial",
    exponent: float = 0.5,
    rt_fraction: float = 0.5,
    latency_weight: float = 1.0,
    robust: RobustAggregation | None = None,
    window: int = 1,
    dwell: int = 1,
) -> Strategy:
    """Build a strategy by name (see `STRATEGIES`).

    Raises:
        ConfigError: Unknown name or bad parameters.

    """
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {name!r}: expected one of {', '.join(sorted(STRATEGIES))}"
        ) from None
    return cls(
        groups, alpha, staleness, exponent, rt_fraction, latency_weight, robust, window, dwell
    )


def strategy_for(spec: FederationSpec) -> Strategy:
    """The strategy a federation spec names, with its parameters."""
    return make_strategy(
        spec.strategy,
        spec.groups,
        spec.mixing,
        spec.staleness,
        spec.exponent,
        spec.rt_fraction,
        spec.latency_weight,
        spec.aggregation,
        spec.latency_window,
        spec.regroup_dwell,
    )
