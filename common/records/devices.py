"""The ``device:<id>`` hash (`DeviceRecord`): a worker's last heartbeat and when it came.

Written by the coordinator at each heartbeat with a TTL renewed by each write,
so a record cannot outlive whoever keeps it fresh (a coordinator that exits, a
peer that only pretended to be a device); deleted when the device is forgotten.
The CLI's `status` lists them. Keys are exact (``device:<name>``); listing
them scans the literal prefix, never a pattern built from a peer's name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from common.errors import StoreError
from common.records._base import RecordModel
from common.store import Store

if TYPE_CHECKING:  # the messages load torch; the CLI's `status` reads records without it
    from common.messages import Heartbeat

__all__ = ["DeviceRecord", "forget_devices", "read_devices", "shown_state", "write_device"]


class DeviceRecord(RecordModel):
    """A device's last heartbeat (`common.messages.Heartbeat`'s fields) and `seen`.

    Loose where the heartbeat is strict: a record an older worker's heartbeat
    wrote still loads, its unknown fields as extras.
    """

    device: str
    seen: float | None = None
    """When the coordinator last heard it (seconds since the epoch)."""
    state: str | None = None
    stage: int | None = None
    round: int | None = None
    memory_budget: int = 0
    threads: int | None = None
    version: str = ""
    fingerprint: str = ""
    data_addr: str = ""
    host: str = ""


def shown_state(d: DeviceRecord, now: float, silent_s: float, stale_s: float) -> str:
    """The state to show for `d` at `now`: its heartbeat's, unless that is too old to trust.

    A record outlives its last heartbeat by the coordinator's expiry and a grace
    (and a Redis restarted from its append-only file brings back whatever was
    written before), so "ready" there may describe a device long gone. Silent
    for longer than `silent_s` (when the coordinator starts suspecting a worker)
    it is "silent"; beyond `stale_s` (the expiry, when it is forgotten) "stale".
    """
    age = None if d.seen is None else now - d.seen
    if age is None or age > stale_s:
        return "stale"
    if age > silent_s:
        return "silent"
    return d.state or "?"


def write_device(store: Store, hb: Heartbeat, seen: float, ttl_s: float) -> None:
    """Record heartbeat `hb`, heard at `seen`; the record expires `ttl_s` after this write."""
    store.set_fields({**hb.model_dump(mode="json"), "seen": seen}, "device", hb.device, ttl_s=ttl_s)


def forget_devices(store: Store, devices: Iterable[str]) -> int:
    """Delete the records of `devices` (exact keys, one per device); how many existed."""
    return store.delete(*(store.key("device", d) for d in devices))


def read_devices(store: Store) -> list[DeviceRecord]:
    """Every device's record, freshest first.

    A record missing since it was listed (expired meanwhile) is skipped; one
    of the wrong shape raises StoreError naming it.
    """
    out = []
    for key in store.keys("device", ""):
        name = key.decode().removeprefix(store.key("device", ""))
        fields = store.get_fields("device", name)
        if not fields:
            continue
        try:
            out.append(DeviceRecord.model_validate({**fields, "device": name}))
        except ValidationError as exc:
            raise StoreError(f"device {name!r}'s record in Redis is malformed: {exc}") from exc
    return sorted(out, key=lambda d: -(d.seen or 0.0))
