"""A serving job's lost and returning devices, decided purely: who is left, who comes back.

A device lost while serving does not end the job: `serve_core` re-plans on
the survivors with the profiles it kept, bumps the epoch (tiles and replies of
the old one are then ignored), has the survivors load their new shards and
re-runs the request that was in flight, as its prompt plus what was generated
so far. What that takes is decided here: the survivors, whether their memory
holds the model (if not, the job ends naming the shortfall), what the loss is
recorded as once the first answer after it is sent, and which devices may
join again at the next idle moment, so that throughput comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from common.errors import AsteroidError
from common.ids import DeviceId
from services.coordinator.core import Log
from services.coordinator.galaxy.planner import require_capacity
from services.coordinator.membership import Members
from services.coordinator.serve_state import AppendMetrics, Command, Recovery, Serve

__all__ = [
    "budgets",
    "idle",
    "joiners",
    "left_job",
    "lost",
    "recovered",
    "shortfall",
    "survivors",
]


def budgets(serve: Serve, devices: Sequence[DeviceId]) -> dict[str, int]:
    """Each device's memory for its shard: what its heartbeat says training may use."""
    return {d: m.info.memory_budget for d in devices if (m := serve.members.get(d)) is not None}


def survivors(serve: Serve, gone: Sequence[DeviceId]) -> list[DeviceId]:
    """The job's devices less `gone` and any no longer known."""
    return [d for d in serve.devices if d not in gone and d in serve.members]


def shortfall(serve: Serve, devices: Sequence[DeviceId]) -> str | None:
    """Why `devices` cannot hold the served model (the planner's wording), or None."""
    if serve.config is None:
        return "the served model is not known yet"
    if not devices:
        return "no device is left to serve on"
    try:
        require_capacity(serve.config, budgets(serve, devices), serve.spec.seq_len)
    except AsteroidError as exc:
        return str(exc)
    return None


def lost(serve: Serve, devices: Sequence[DeviceId], reason: str, now: float) -> Serve:
    """The job once `devices` are declared lost at `now`: remembered, the loss timed.

    A loss during the recovery of another keeps the first one's start: the
    recovery time runs from the first loss to the first answer after both.
    """
    heard = [m.last_seen for d in devices if (m := serve.members.get(d)) is not None]
    since = min(heard, default=now)
    first = serve.recovery
    recovery = Recovery(
        lost=tuple(dict.fromkeys([*(first.lost if first else ()), *devices])),
        silent_since=min(since, first.silent_since) if first else since,
        declared=first.declared if first else now,
        reason=first.reason if first else reason,
    )
    gone = {**serve.gone, **{d: now for d in devices}}
    return replace(serve, recovery=recovery, gone=gone)


def recovered(serve: Serve, now: float) -> tuple[Serve, list[Command]]:
    """The first answer after a loss was sent: record how long the service was down."""
    rec = serve.recovery
    if rec is None:
        return serve, []
    entry = {
        "recovered": True,
        "lost": list(rec.lost),
        "recovery_s": round(now - rec.silent_since, 6),
        "detect_s": round(rec.declared - rec.silent_since, 6),
        "serving_on": list(serve.plan.devices) if serve.plan else [],
    }
    commands: list[Command] = [
        AppendMetrics("the recovery after a device loss", entry),
        Log(
            "info",
            "recovered from a device loss",
            {k: v for k, v in entry.items() if k != "recovered"} | {"reason": rec.reason},
        ),
    ]
    return replace(serve, recovery=None), commands


def joiners(serve: Serve, now: float) -> list[DeviceId]:
    """Devices that may join the job now: lost ones heard from again since their loss.

    A job started on every connected worker (no devices named) also takes a
    worker it never had, but only in place of one it lost: new workers do not
    grow it past its size at the start. Heard from means a heartbeat within the
    heartbeat deadline, with no probe open on it.
    """
    if not serve.gone:
        return []

    def fresh(d: DeviceId, since: float) -> bool:
        m = serve.members.get(d)
        return (
            m is not None
            and m.last_seen > since
            and now - m.last_seen <= serve.limits.heartbeat_deadline_s
            and d not in serve.probes
        )

    back = [d for d, at in sorted(serve.gone.items()) if fresh(d, at)]
    if serve.spec.devices:
        return [d for d in back if d in serve.spec.devices]
    room = serve.size - len(serve.devices) - len(back)
    others = [
        d
        for d in sorted(serve.members)
        if d not in serve.devices and d not in serve.gone and fresh(d, -1.0)
    ]
    return back + others[: max(0, room)]


def left_job(serve: Serve, members: Members) -> list[DeviceId]:
    """Devices of a planned job that the membership forgot (a wait would never hear of them)."""
    if serve.phase not in ("loading", "serving") or serve.plan is None:
        return []
    return [d for d in serve.devices if d not in members]


def idle(serve: Serve) -> bool:
    """Serving, and nothing under way or asked for: devices may join now."""
    return (
        serve.phase == "serving"
        and serve.wait is None
        and serve.running is None
        and not serve.taking
        and serve.cancel is None
    )
