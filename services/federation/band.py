"""The regrouping band's defence against timing noise: a smoothed latency and a dwell.

Algorithm 1 judges a home by its latest round time against ``RT^g = rt_fraction * L^g``.
Round times of real homes jitter (a scheduler burst, a collection pause, a late
upload), and one such round out of band is enough to move or drop the home, which
churns groups and wastes rounds on probes. Two knobs, both pure on plain numbers:

- ``window``: a home is judged by the median of its last ``window`` measured latencies,
  so fewer than half of them being outliers leaves its judged latency among its
  ordinary values. A sustained change shows after ``window // 2 + 1`` measurements.
- ``dwell``: a home changes group (move, drop, rejoin) only after ``dwell``
  consecutive measurements that each call for a change; any measurement that does
  not resets the count. A home that just changed group therefore stays at least
  ``dwell`` of its measurements where it went.

``window = dwell = 1`` is Algorithm 1 as published. A real, sustained change of
latency still regroups, after at most ``window // 2 + dwell`` of its measurements.

`unheld_homes` tells, right after the groups are formed, which homes no band holds:
with steady latencies Algorithm 1 drops them (they only probe), and at strong label
skew their classes go missing from the global model. Homes spread evenly over a wide
range, rather than in clusters each narrower than the band, are the case.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import ConfigError

__all__ = [
    "MAX_WINDOW",
    "Unheld",
    "check_band",
    "median",
    "pushed",
    "settle_bound",
    "unheld_homes",
]

MAX_WINDOW = 1000
"""Most measurements a home's judged latency may look back on, and most dwell."""


def check_band(window: int, dwell: int) -> None:
    """Both knobs in ``[1, MAX_WINDOW]``.

    Raises:
        ConfigError: One is out of range.

    """
    if not (1 <= window <= MAX_WINDOW and 1 <= dwell <= MAX_WINDOW):
        raise ConfigError(
            f"need latency window and regroup dwell in [1, {MAX_WINDOW}], got {window} and {dwell}"
        )


def median(values: Sequence[float]) -> float:
    """The middle value (mean of the two middle ones for an even count).

    Raises:
        ConfigError: No values.

    """
    if not values:
        raise ConfigError("the median of no latencies is undefined")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def pushed(recent: Sequence[float], latency: float, window: int) -> tuple[float, ...]:
    """``recent`` with ``latency`` appended, keeping the last ``window`` values."""
    return (*recent, latency)[-window:]


def settle_bound(window: int, dwell: int) -> int:
    """Most measurements after a sustained change before the home changes group."""
    return window // 2 + dwell


@dataclass(frozen=True)
class Unheld:
    """Homes that no group's band holds at their measured latency: Algorithm 1 drops them.

    Attributes:
        homes: ``(home, latency)`` of each such home, by id.
        rt_fraction: The band, ``RT^g = rt_fraction * L^g``.
        needed: The smallest ``rt_fraction`` that keeps every home in its own group.

    """

    homes: tuple[tuple[int, float], ...]
    rt_fraction: float
    needed: float

    def warning(self) -> str:
        """One line for the log and the federation's status."""
        named = ", ".join(f"home {h} ({lat:.3g} s)" for h, lat in self.homes)
        return (
            f"Eco-FL cannot hold its groups: {named} fit no group's band at rt_fraction "
            f"{self.rt_fraction:g}, so Algorithm 1 drops homes (they only probe, their data "
            f"unused) while latencies stay; rt_fraction {self.needed:.3g} would hold the "
            "initial groups; FedAsync and FedAT drop no home"
        )


def _ref(members: Sequence[int], latencies: Sequence[float], home: int) -> float | None:
    others = [latencies[m] for m in members if m != home]
    return sum(others) / len(others) if others else None


def _least_band(gap: float, ref: float) -> float:
    """The smallest float ``f`` with ``gap <= f * ref`` (``gap / ref`` may round below)."""
    f = gap / ref
    while f * ref < gap:
        f = math.nextafter(f, math.inf)
    return f


def unheld_homes(
    groups: Sequence[Sequence[int]], latencies: Sequence[float], rt_fraction: float
) -> Unheld | None:
    """The homes Algorithm 1 would drop, each judged alone against ``groups``; None if none.

    A home stays while ``|L^g - L_n| <= RT^g`` for its own group ``g`` (``L^g`` without
    the home; a lone member always stays), else moves to a group whose band holds it
    strictly, else drops: `services.federation.grouping.regroup` on that one home. Only
    homes in ``groups`` are judged (dropped ones are out already). After a round the
    server judges its homes one after another, and a home that leaves shifts its
    group's ``L^g``, so the homes that in fact drop may be others of the same group: a
    group at 1.2, 0.45 and 0.9 s names homes 0 and 1 here, and Algorithm 1 drops 0, then
    2 (judged against home 1 alone).

    Raises:
        ConfigError: A latency that is not > 0, a home without a latency, or a band
            that is not > 0.

    """
    if not rt_fraction > 0:
        raise ConfigError(f"need rt_fraction > 0, got {rt_fraction}")
    if any(not lat > 0 for lat in latencies):
        raise ConfigError(f"latencies must be > 0, got {list(latencies)}")
    if any(not 0 <= h < len(latencies) for g in groups for h in g):
        raise ConfigError(f"groups {groups} name homes beyond the {len(latencies)} latencies")
    out: list[tuple[int, float]] = []
    needed = 0.0
    for g, members in enumerate(groups):
        for home in members:
            lat = latencies[home]
            ref = _ref(members, latencies, home)
            if ref is None:
                continue
            needed = max(needed, _least_band(abs(ref - lat), ref))
            if abs(ref - lat) <= rt_fraction * ref:
                continue
            held = False
            for k, other in enumerate(groups):
                r = _ref(other, latencies, home) if k != g else None
                held = held or (r is not None and abs(r - lat) < rt_fraction * r)
            if not held:
                out.append((home, float(lat)))
    if not out:
        return None
    return Unheld(tuple(sorted(out)), rt_fraction, needed)
