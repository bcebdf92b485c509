"""The bounds of a running job's waits: the settings as the job core sees them.

A value of its own (not the settings) so the core stays pure, and so the shell
can hand the core new bounds as the timeouts derived from measurements change
(`timeouts.derive`); each step's wait takes the bounds in force when it begins.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.coordinator.core import DEFAULT_FLAP_GRACE_S

__all__ = ["Limits"]


@dataclass(frozen=True)
class Limits:
    """The coordinator's settings that bound waits, and the longest Redis outage a job rides out."""

    round_timeout_s: float
    heartbeat_deadline_s: float
    """Silence longer than this (heartbeat interval times misses) makes a suspect."""
    probe_timeout_s: float
    hung_min_s: float
    hung_factor: float
    redis_outage_s: float = 120.0
    flap_grace_s: float = DEFAULT_FLAP_GRACE_S
    """A closed connection that comes back within this is no loss (`detection`)."""
