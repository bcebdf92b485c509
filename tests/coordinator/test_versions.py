"""A worker on another release is warned of once, not on every heartbeat."""

from __future__ import annotations

from common.ids import DeviceId
from services.coordinator.versions import forget_versions, note_version

A, B = DeviceId("a"), DeviceId("b")


def test_another_release_is_warned_of_once_per_device() -> None:
    seen, warn = note_version({}, A, "0.9", "1.0")
    assert warn and seen == {A: "0.9"}
    for _ in range(3):  # the next heartbeats of the same release
        seen, warn = note_version(seen, A, "0.9", "1.0")
        assert not warn
    seen, warn = note_version(seen, B, "0.8", "1.0")
    assert warn and seen == {A: "0.9", B: "0.8"}


def test_the_same_release_is_never_warned_of() -> None:
    seen, warn = note_version({}, A, "1.0", "1.0")
    assert not warn and seen == {A: "1.0"}


def test_a_device_that_changes_release_is_warned_of_again() -> None:
    seen, _ = note_version({}, A, "0.9", "1.0")
    seen, warn = note_version(seen, A, "1.0", "1.0")  # upgraded: nothing to say
    assert not warn
    seen, warn = note_version(seen, A, "0.9", "1.0")  # and back
    assert warn


def test_an_unknown_release_is_not_warned_of() -> None:
    _, warn = note_version({}, A, "", "1.0")
    assert not warn


def test_forgotten_devices_leave_the_record() -> None:
    seen, _ = note_version({}, A, "0.9", "1.0")
    seen, _ = note_version(seen, B, "1.0", "1.0")
    assert forget_versions(seen, [A]) == {B: "1.0"}
    seen2, warn = note_version(forget_versions(seen, [A]), A, "0.9", "1.0")
    assert warn and seen2[A] == "0.9"  # back after being forgotten: named again
