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
"""

from collections.abc import Sequence

from common.errors import ConfigError

__all__ = ["MAX_WINDOW", "check_band", "median", "pushed", "settle_bound"]

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
