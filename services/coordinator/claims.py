"""What a device's heartbeat claims, held against what its fingerprint says.

A heartbeat is the device's own word: threads, cores, CPU quota, memory and
the fingerprint its profiles are keyed by. The planner believes a device's
speed only through the profile stored under that fingerprint, which a
profiler measured on a device that computed the same fingerprint; so a claim
is believed only as far as it agrees with the fingerprint it names. The
fingerprint's readable part (`common.device.device_fingerprint`: arch,
cores, threads, quota, GPU, memory) is that agreement's yardstick: a device that
names another kind's fingerprint but claims other numbers is left
unprofiled, and no claim makes the planner see more memory than the
fingerprint's device has. Pure functions, tested without sockets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.messages import MAX_DEVICE_MEMORY, Heartbeat

__all__ = ["FingerprintFacts", "claim_problem", "facts", "memory_cap"]

_READABLE = re.compile(
    r"^(?P<arch>[A-Za-z0-9_]+)-(?P<cores>\d+)c-(?P<threads>\d+)t"
    r"(?:-q(?P<quota>[0-9.e+-]+))?(?:-(?P<accelerator>cuda[A-Za-z0-9_]*))?"
    r"-(?P<mem>\d+\.\d)g-(?P<digest>[0-9a-f]{10})$"
)
_GIB = 1 << 30
_ROUNDING = _GIB // 20
"""The fingerprint shows memory in tenths of a GiB: half a tenth either way is the same."""


@dataclass(frozen=True)
class FingerprintFacts:
    """What a fingerprint's readable part says about the device that computed it."""

    cores: int
    threads: int
    quota: float | None
    memory_bytes: int
    """The memory it was computed with, to the nearest tenth of a GiB."""


def facts(fingerprint: str) -> FingerprintFacts | None:
    """The readable part of `fingerprint`, or None when it is not one `device_fingerprint` makes."""
    m = _READABLE.match(fingerprint)
    if m is None:
        return None
    try:
        quota = None if m["quota"] is None else float(m["quota"])
    except ValueError:
        return None
    return FingerprintFacts(
        cores=int(m["cores"]),
        threads=int(m["threads"]),
        quota=quota,
        memory_bytes=round(float(m["mem"]) * _GIB),
    )


def claim_problem(hb: Heartbeat) -> str | None:
    """Why `hb`'s claims cannot be planned with (None: they agree with its fingerprint).

    Threads, cores and quota must be the fingerprint's; a configured memory
    budget (part of the fingerprint) must be its memory.
    """
    if not hb.fingerprint:
        return "it reports no device fingerprint"
    f = facts(hb.fingerprint)
    if f is None:
        return f"its fingerprint {hb.fingerprint!r} is not one a device computes"
    quota = hb.cpu_quota or None
    wrong = [
        f"{name} {claimed} (fingerprint: {said})"
        for name, claimed, said in (
            ("threads", hb.threads, f.threads),
            ("cores", hb.cores, f.cores),
        )
        if claimed != said
    ]
    if (quota is None) != (f.quota is None) or (
        quota is not None and f.quota is not None and abs(quota - f.quota) > 0.001 * f.quota
    ):
        wrong.append(f"cpu_quota {hb.cpu_quota:g} (fingerprint: {f.quota or 0:g})")
    if hb.memory_configured and abs(hb.memory_configured - f.memory_bytes) > _ROUNDING:
        wrong.append(f"memory_configured {hb.memory_configured} (fingerprint: {f.memory_bytes})")
    if wrong:
        return f"it claims {', '.join(wrong)} unlike the fingerprint it names"
    return None


def memory_cap(hb: Heartbeat) -> int:
    """The most training memory the planner may believe `hb`: its fingerprint's memory at most.

    The wire's bound when the fingerprint says nothing (`claim_problem` keeps
    such a device out of a plan already) or names no memory (a device that
    cannot read its own, such as one without ``/proc/meminfo``).
    """
    f = facts(hb.fingerprint)
    return MAX_DEVICE_MEMORY if f is None or not f.memory_bytes else f.memory_bytes + _ROUNDING
