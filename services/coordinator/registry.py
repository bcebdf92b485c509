"""Who is in the cluster: devices by their heartbeats, services by their hellos.

The decisions are `membership`'s pure functions (admit, expire, forget, probe
answers); this module applies them to the coordinator's registry, writes each
device's record to Redis (at once for a new device, then at most once a second,
with a TTL so the record goes with its sender) and logs what changed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from common.ids import DeviceId
from common.logging import get_logger
from common.messages import Heartbeat, ServiceHello
from common.records.devices import forget_devices, write_device
from common.settings import CoordinatorSettings
from common.store import OUTAGE, REFUSED, Store
from common.version import VERSION
from services.coordinator.membership import (
    Members,
    Probes,
    Rules,
    Verdict,
    admit,
    dead,
    expired,
    forget,
    on_probe_reply,
)
from services.coordinator.versions import forget_versions, note_version
from services.coordinator.writes import Writes

__all__ = ["DEVICE_RECORD_GRACE_S", "DEVICE_WRITE_EVERY_S", "Registry"]

log = get_logger(__name__)
DEVICE_WRITE_EVERY_S = 1.0
"""Least time between two Redis writes of one device's heartbeat state."""
DEVICE_RECORD_GRACE_S = 10.0
"""A device's Redis record outlives its last heartbeat write by the expiry time plus this:
renewed while it heartbeats, gone soon after it (or the coordinator) stops."""


class Registry:
    """The devices and services the coordinator knows, kept current."""

    def __init__(self, settings: CoordinatorSettings, store: Store, writes: Writes) -> None:
        self.settings, self.store, self.writes = settings, store, writes
        # never forget a device before it would be declared dead: a job waiting on it
        # must see it dead, not absent
        dead_s = settings.heartbeat_s * settings.heartbeat_misses
        self.rules = Rules(
            DEVICE_WRITE_EVERY_S,
            max(settings.device_expiry_s, dead_s),
            settings.max_unassigned_devices,
        )
        self.members: Members = {}
        self.versions: Mapping[DeviceId, str] = {}
        """The release each member last reported, so another release is warned of once."""
        self.probes: Probes = {}
        """Probes sent to suspects and not answered yet."""
        self.services: dict[str, float] = {}
        """Each service's name and when its last hello came (monotonic seconds)."""
        self.heartbeat_counts = {v: 0 for v in Verdict} | {"expired": 0, "unrecorded": 0}
        """Heartbeats by what became of them, devices forgotten, and device writes Redis
        missed during an outage; logged when they change."""
        self._logged_counts = dict(self.heartbeat_counts)
        self._next_sweep = 0.0

    def heartbeat(self, hb: Heartbeat, now: float, keep: frozenset[DeviceId]) -> None:
        """Remember `hb`; write it to Redis at once for a new device, else at most once a second.

        A new id beyond the cap of unassigned devices is dropped; the first
        such drop is logged with its sender, later ones only counted. `keep`:
        devices exempt from the cap (the running job's).
        """
        self.members, verdict = admit(self.members, hb, now, self.rules, keep)
        self.heartbeat_counts[verdict] += 1
        if verdict is Verdict.DROPPED:
            if self.heartbeat_counts[verdict] == 1:
                log.warning(
                    "dropped heartbeat of a new device: too many unassigned devices",
                    peer=hb.device,
                    expected=f"at most {self.rules.max_unassigned}",
                )
            return
        if verdict is Verdict.JOINED:
            log.info("worker joined", worker=hb.device, data=hb.data_addr, version=hb.version)
        self.versions, warn = note_version(self.versions, hb.device, hb.version, VERSION)
        if warn:
            log.warning(
                "worker runs another release than the coordinator",
                worker=hb.device,
                worker_version=hb.version,
                coordinator_version=VERSION,
            )
        if verdict is not Verdict.LIMITED:
            try:
                write_device(
                    self.store,
                    hb,
                    seen=time.time(),
                    ttl_s=self.rules.expiry_s + DEVICE_RECORD_GRACE_S,  # gone with the sender
                )
            except (*OUTAGE, *REFUSED):  # the next heartbeat's write a second later catches up
                self.heartbeat_counts["unrecorded"] += 1

    def probe_answered(self, device: DeviceId, nonce: int, now: float) -> None:
        """A suspect answered a probe no wait is judging: clear it, whatever its heartbeats."""
        self.members, self.probes, counted = on_probe_reply(
            self.members, self.probes, device, nonce, now
        )
        if counted:
            log.info("suspect answered the probe", device=device)
        else:  # late (the device was declared dead meanwhile) or stale
            log.info("ignored a probe answer nobody waits for", device=device, nonce=nonce)

    def hello(self, msg: ServiceHello, peer: str, now: float) -> None:
        """A service announced itself: it may be asked for plans or profiles."""
        if msg.service not in self.services:
            log.info("service joined", service=msg.service, peer=peer)
        self.services[msg.service] = now

    def alive(self, now: float) -> Members:
        """Workers whose heartbeats are current."""
        s = self.settings
        gone = set(dead(self.members, now, s.heartbeat_s, s.heartbeat_misses))
        return {d: m for d, m in self.members.items() if d not in gone}

    def sweep(self, now: float, keep: frozenset[DeviceId]) -> None:
        """Forget devices not heard from for the expiry time (memory and their Redis key).

        Runs at most a few times a second; also logs the heartbeat counters
        when they changed, so a flood shows in the log without a line per message.
        `keep`: devices never forgotten (the running job's).
        """
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.rules.expiry_s / 4)
        gone = expired(self.members, now, self.rules.expiry_s, keep)
        if gone:
            self.members = forget(self.members, gone)
            self.versions = forget_versions(self.versions, gone)
            # exact keys, one per device: never a pattern built from a peer's name
            self.writes.write_soon(
                "forget silent devices", lambda: forget_devices(self.store, gone)
            )
            self.heartbeat_counts["expired"] += len(gone)
            log.info("forgot silent devices", count=len(gone), first=gone[0])
        if self.heartbeat_counts != self._logged_counts:
            self._logged_counts = dict(self.heartbeat_counts)
            log.info(
                "heartbeat counts",
                **{str(getattr(k, "value", k)): v for k, v in self.heartbeat_counts.items()},
                known=len(self.members),
            )
