"""Which release each worker runs, so a device left on another one is named once.

A pure function of what was seen: the coordinator warns the first time a
device reports a release other than its own (and again only if that device's
release changes), never on every heartbeat.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from common.ids import DeviceId

__all__ = ["forget_versions", "note_version"]


def note_version(
    seen: Mapping[DeviceId, str], device: DeviceId, version: str, mine: str
) -> tuple[Mapping[DeviceId, str], bool]:
    """(what is seen now, whether to warn) after `device` reported release `version`.

    Warns when `version` differs from `mine` and is not what this device last
    reported; an empty version (a sender that did not say) is never warned about.
    """
    if seen.get(device) == version:
        return seen, False  # the common case, every heartbeat: nothing copied
    return {**seen, device: version}, bool(version) and version != mine


def forget_versions(seen: Mapping[DeviceId, str], gone: Iterable[DeviceId]) -> dict[DeviceId, str]:
    """`seen` without the devices the coordinator forgot, so it stays bounded by the members."""
    drop = set(gone)
    return {d: v for d, v in seen.items() if d not in drop}
