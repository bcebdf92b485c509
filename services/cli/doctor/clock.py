"""How far this device's clock is from the cluster's.

Logs, events and timelines of several devices are put side by side by their
wall-clock times, and a Raspberry Pi has no battery-backed clock: one booted
without network time can be hours off. The reference is the coordinator (the
time in its replies' headers), else Redis's TIME when the coordinator did
not answer; the report says which.
"""

from __future__ import annotations

from services.cli.doctor.report import Check

__all__ = ["CLOCK_TOLERANCE_S", "clock_check"]

CLOCK_TOLERANCE_S = 1.0
"""Largest offset taken as in sync: NTP keeps a LAN's clocks within milliseconds, a clock
that never synced is seconds to hours off, and one second still orders a round's events."""


def clock_check(offset_s: float | None, rtt_s: float | None, source: str) -> Check:
    """The `clock` row: the offset to `source` (``coordinator`` or ``redis``), or why unknown."""
    if offset_s is None or rtt_s is None:
        return Check(
            "clock",
            "skipped",
            "not known: neither the coordinator nor Redis gave its time",
            data={"source": None},
        )
    text = f"the {source}'s minus this device's: {offset_s * 1000:+.1f} ± {rtt_s * 500:.1f} ms"
    data = {"source": source, "offset_s": offset_s, "uncertainty_s": rtt_s / 2}
    if abs(offset_s) - rtt_s / 2 > CLOCK_TOLERANCE_S:
        return Check(
            "clock",
            "problem",
            f"{text}: more than {CLOCK_TOLERANCE_S:g} s apart",
            "sudo timedatectl set-ntp true (on this device and the coordinator's)",
            data,
        )
    return Check("clock", "ok", text, data=data)
