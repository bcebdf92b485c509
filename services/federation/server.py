"""The federation's bookkeeping as a pure state machine.

Who trains what, when a group's round ends, what the global model becomes.

No sockets and no clock of its own (every call takes ``now``), so the service, its
tests and a simulated federation drive the same rules:

- Homes join with their sample count and label histogram. Until every expected home
  has joined, everyone waits.
- The first round is one synchronous round of all homes: it measures each home's
  response latency, from which the strategy forms its groups (`Strategy.start`).
- From then on each group runs rounds on its own: the first member to ask starts the
  group's round on the current global model; the round ends when every member has
  sent its update (or ``round_timeout_s`` after it started, with those that did;
  the others count as failures and their latency as the time waited), and the
  strategy merges it into the global model and regroups from the measured latencies.
- Before a round is merged, the strategy screens its updates (`Strategy.screen`): a
  non-finite one, or one whose delta from the global model or sample count is far
  outside the others', is rejected or clipped, and the round's `RoundEnd` names the
  home and the reason. A home claiming more samples than the configured maximum is
  refused when it joins.
- After the ``updates``-th update every home is told ``done``; a round still running
  then is closed when its updates arrive but no longer merged.
- A home out of every group (dropped by Algorithm 1) keeps training on the current
  global model as a *probe*: its update is not merged, but its latency is measured,
  so it rejoins when some group's band holds it again.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from common.errors import ConfigError
from services.federation.band import Unheld, unheld_homes
from services.federation.grouping import GroupState
from services.federation.robust import Screened
from services.federation.strategies import FitResult, Strategy

__all__ = ["Federation", "FederationError", "Regroup", "RoundEnd", "StaleUpdate", "Task"]


class FederationError(ConfigError):
    """A home's request the federation cannot take (it names the home and why)."""


class StaleUpdate(FederationError):
    """An update for a round that is no longer running with the home.

    Closed by its timeout, say: nothing is wrong with the home, which simply asks
    for its next task.
    """


@dataclass(frozen=True)
class Task:
    """What a home is told to do next.

    Attributes:
        status: ``train`` (send an update of ``state``), ``probe`` (train and send
            it, only the latency counts), ``wait`` (ask again later), ``done``.
        round_id: The round the home's update belongs to.
        version: Version of ``state``.
        state: The model to start from (None unless training or probing).

    """

    status: Literal["train", "probe", "wait", "done"]
    round_id: int = -1
    version: int = 0
    state: Mapping[str, Tensor] | None = None


@dataclass(frozen=True)
class Regroup:
    """A home that moved, dropped out or rejoined after a round (group None: out)."""

    home: int
    action: str
    group: int | None


@dataclass(frozen=True)
class RoundEnd:
    """A round that ended: a group's (merged into the global model) or a probe's.

    ``group`` is the group's index, `Federation.WARMUP` for the first round of all
    homes, None for a dropped home's probe. ``latencies`` are the members' measured
    ones in ``members``' order (a failed home's: the time waited for it), so that the
    noise the regrouping band faces can be read from the record. ``unheld``, on the
    first round only, names the homes the strategy's band cannot hold (`unheld_homes`).
    """

    round_id: int
    group: int | None
    members: tuple[int, ...]
    failed: tuple[int, ...]
    version: int
    regroups: tuple[Regroup, ...]
    screened: tuple[Screened, ...] = ()
    latencies: tuple[float, ...] = ()
    unheld: Unheld | None = None


@dataclass
class _Round:
    round_id: int
    group: int | None
    members: tuple[int, ...]
    probe: bool
    state: dict[str, Tensor]
    version: int
    started: float
    results: dict[int, FitResult] = field(default_factory=dict)
    latencies: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Home:
    num_samples: int
    histogram: tuple[int, ...]


class Federation:
    """Rounds, groups and the global model of one federation (see the module doc)."""

    WARMUP = -1
    """The group index of the first round (all homes, before any grouping)."""

    def __init__(
        self,
        strategy: Strategy,
        initial: Mapping[str, Tensor],
        homes: int,
        updates: int,
        round_timeout_s: float,
        first_round: int = 0,
    ) -> None:
        """Start with the `initial` global model; no home has joined.

        `first_round`: the first round id; a restarted service starts past the ids
        its predecessor gave, so a home's update for one of those is never taken as new.
        """
        if homes < 1 or updates < 1 or not round_timeout_s > 0:
            raise ConfigError(
                f"need homes >= 1, updates >= 1, round_timeout_s > 0; got {homes}, {updates}, "
                f"{round_timeout_s}"
            )
        self.strategy = strategy
        self.state = {k: v.detach().clone() for k, v in initial.items()}
        self.version = 0
        self.homes, self.updates, self.round_timeout_s = homes, updates, round_timeout_s
        self.joined: dict[int, _Home] = {}
        self.groups: GroupState | None = None
        self.rounds: dict[int, _Round] = {}
        """Running rounds by id; a home is in at most one."""
        self._ids = itertools.count(first_round)

    @property
    def done(self) -> bool:
        """True once the global model has had its last update."""
        return self.version >= self.updates

    def join(self, home: int, num_samples: int, histogram: Sequence[int]) -> None:
        """Admit a home (again, after a restart: same data, so same figures).

        Raises:
            FederationError: Unknown home id, no samples or more than the configured
                maximum, or a histogram whose length or total disagrees with what the
                home reported before.

        """
        if not 0 <= home < self.homes:
            raise FederationError(f"home {home}: this federation has homes 0..{self.homes - 1}")
        if num_samples < 1 or sum(histogram) != num_samples:
            raise FederationError(
                f"home {home}: its label histogram sums to {sum(histogram)}, not its "
                f"{num_samples} samples"
            )
        most = self.strategy.robust.max_samples
        if num_samples > most:
            raise FederationError(
                f"home {home}: claims {num_samples} samples, the most a home may claim is {most}"
            )
        known = next(iter(self.joined.values()), None)
        if known is not None and len(known.histogram) != len(histogram):
            raise FederationError(
                f"home {home}: {len(histogram)} classes, the federation has {len(known.histogram)}"
            )
        before = self.joined.get(home)
        now = _Home(num_samples, tuple(histogram))
        if before is not None and before != now:
            raise FederationError(
                f"home {home} joined again with other data than before ({num_samples} "
                f"samples, earlier {before.num_samples})"
            )
        self.joined[home] = now

    def task(self, home: int, now: float) -> Task:
        """The home's next task; starts its group's round if none is running.

        Raises:
            FederationError: The home has not joined.

        """
        self._check_joined(home)
        if self.done:
            return Task("done", version=self.version)
        mine = self._round_of(home)
        if mine is not None:
            if home in mine.results or home in mine.latencies:
                return Task("wait", mine.round_id, self.version)
            status: Literal["train", "probe"] = "probe" if mine.probe else "train"
            return Task(status, mine.round_id, mine.version, mine.state)
        if len(self.joined) < self.homes:
            return Task("wait", version=self.version)
        if self.groups is None:
            rnd = self._start(self.WARMUP, tuple(range(self.homes)), False, now)
        else:
            g = self.groups.group_of(home)
            if g is None:
                rnd = self._start(None, (home,), True, now)
            elif any(r.group == g for r in self.rounds.values()):
                return Task("wait", version=self.version)  # moved in while its group trains
            else:
                rnd = self._start(g, self.groups.groups[g], False, now)
        status = "probe" if rnd.probe else "train"
        return Task(status, rnd.round_id, rnd.version, rnd.state)

    def submit(
        self,
        home: int,
        round_id: int,
        state: Mapping[str, Tensor],
        num_samples: int,
        latency_s: float,
        now: float,
    ) -> RoundEnd | None:
        """Take a home's update; when it completes its round, merge and regroup.

        Raises:
            FederationError: Not joined, not a member of a running round
                ``round_id`` (closed by its timeout, say), already sent, a sample
                count other than it joined with, or a latency that is not > 0.

        """
        self._check_joined(home)
        rnd = self.rounds.get(round_id)
        if rnd is None or home not in rnd.members:
            raise StaleUpdate(
                f"home {home}: round {round_id} is not running with it (closed by the "
                f"{self.round_timeout_s:g} s round timeout, or never its round); ask for a task"
            )
        if home in rnd.results or home in rnd.latencies:  # a resent update: nothing to do
            raise StaleUpdate(f"home {home}: already sent its update of round {round_id}")
        if num_samples != self.joined[home].num_samples:
            raise FederationError(
                f"home {home}: trained on {num_samples} samples, joined with "
                f"{self.joined[home].num_samples}"
            )
        if not latency_s > 0:
            raise FederationError(f"home {home}: latency must be > 0, got {latency_s}")
        rnd.latencies[home] = latency_s
        if not rnd.probe:
            rnd.results[home] = FitResult(home, dict(state), num_samples, rnd.version)
        if len(rnd.latencies) == len(rnd.members):
            return self._close(rnd, now)
        return None

    def expire(self, now: float) -> list[RoundEnd]:
        """Close every round older than the timeout with the updates it has."""
        old = [r for r in self.rounds.values() if now - r.started > self.round_timeout_s]
        return [self._close(r, now) for r in old if r.round_id in self.rounds]

    def snapshot(self) -> dict[str, Any]:
        """Everything but the model a restarted federation needs: version, homes, groups.

        Running rounds are not kept: their homes' updates come back refused as
        stale, and the homes ask for new tasks.
        """
        groups = self.groups
        return {
            "version": self.version,
            "joined": {str(h): [j.num_samples, list(j.histogram)] for h, j in self.joined.items()},
            "groups": None
            if groups is None
            else {
                "groups": [list(g) for g in groups.groups],
                "latencies": list(groups.latencies),
                "dropped": sorted(groups.dropped),
                "recent": [list(r) for r in groups.recent],
                "strikes": list(groups.strikes),
            },
        }

    def restore(self, snapshot: Mapping[str, Any], state: Mapping[str, Tensor]) -> None:
        """Continue from `snapshot` (as `snapshot` wrote it) and the global model `state`.

        Raises:
            FederationError: The snapshot does not fit this federation (other homes,
                a malformed field).

        """
        try:
            self.joined = {}
            for home, (num_samples, histogram) in dict(snapshot["joined"]).items():
                self.join(int(home), int(num_samples), [int(c) for c in histogram])
            self.version = int(snapshot["version"])
            self.state = {k: v.detach().clone() for k, v in state.items()}
            grouped = snapshot["groups"]
            if grouped is not None:
                self.groups = GroupState(
                    groups=tuple(tuple(int(h) for h in g) for g in grouped["groups"]),
                    latencies=tuple(float(x) for x in grouped["latencies"]),
                    histograms=tuple(
                        tuple(float(c) for c in self.joined[h].histogram) for h in range(self.homes)
                    ),
                    dropped=frozenset(int(h) for h in grouped["dropped"]),
                    rt_fraction=self.strategy.rt_fraction,
                    latency_weight=self.strategy.latency_weight,
                    window=self.strategy.window,
                    dwell=self.strategy.dwell,
                    recent=_band_history(grouped.get("recent"), self.strategy.window),
                    strikes=_band_strikes(grouped.get("strikes"), self.strategy.dwell),
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise FederationError(f"the stored federation state does not fit: {exc!r}") from exc
        self.rounds = {}

    def _check_joined(self, home: int) -> None:
        if home not in self.joined:
            raise FederationError(f"home {home} has not joined this federation")

    def _round_of(self, home: int) -> _Round | None:
        return next((r for r in self.rounds.values() if home in r.members), None)

    def _start(
        self, group: int | None, members: tuple[int, ...], probe: bool, now: float
    ) -> _Round:
        rnd = _Round(
            next(self._ids),
            group,
            members,
            probe,
            self.state,
            self.version,
            now,
        )
        self.rounds[rnd.round_id] = rnd
        return rnd

    def _close(self, rnd: _Round, now: float) -> RoundEnd:
        del self.rounds[rnd.round_id]
        failed = tuple(h for h in rnd.members if h not in rnd.latencies)
        waited = max(now - rnd.started, 1e-9)
        latencies = {h: rnd.latencies.get(h, waited) for h in rnd.members}
        measured = tuple(latencies[h] for h in rnd.members)
        if rnd.probe:
            probed = self._observe(latencies)
            return RoundEnd(
                rnd.round_id, None, rnd.members, failed, self.version, probed, (), measured
            )
        results = [rnd.results[h] for h in rnd.members if h in rnd.results]
        screened: tuple[Screened, ...] = ()
        if results and not self.done:  # after the last update, a late round changes nothing
            results, screened = self.strategy.screen(rnd.state, results)
        if results and not self.done:
            self.state = self.strategy.aggregate_fit(self.state, self.version, results, failed)
            self.version += 1
        if self.groups is None:
            order = range(self.homes)
            self.groups = self.strategy.start(
                [latencies[h] for h in order], [self.joined[h].histogram for h in order]
            )
            regroups: tuple[Regroup, ...] = ()
            unheld = self._unheld()
        else:
            regroups, unheld = self._observe(latencies), None
        return RoundEnd(
            rnd.round_id,
            rnd.group,
            rnd.members,
            failed,
            self.version,
            regroups,
            screened,
            measured,
            unheld,
        )

    def _unheld(self) -> Unheld | None:
        """Homes the first groups' band cannot hold, for a strategy that drops homes."""
        assert self.groups is not None
        if not self.strategy.drops_homes:
            return None
        grouped = self.groups
        return unheld_homes(grouped.groups, grouped.latencies, grouped.rt_fraction)

    def _observe(self, latencies: Mapping[int, float]) -> tuple[Regroup, ...]:
        assert self.groups is not None
        moved = []
        for home, latency in sorted(latencies.items()):
            outcome = self.strategy.observe(self.groups, home, latency)
            self.groups = outcome.state
            if outcome.action not in ("stay", "out"):
                moved.append(Regroup(home, outcome.action, outcome.group))
        return tuple(moved)


def _band_history(stored: Any, window: int) -> tuple[tuple[float, ...], ...]:
    """A snapshot's recent latencies, cut to this federation's window (older: none)."""
    if stored is None:
        return ()
    return tuple(tuple(float(x) for x in r)[-window:] for r in stored)


def _band_strikes(stored: Any, dwell: int) -> tuple[int, ...]:
    """A snapshot's strike counts, capped below this federation's dwell (older: none)."""
    if stored is None:
        return ()
    return tuple(min(int(k), dwell - 1) for k in stored)
