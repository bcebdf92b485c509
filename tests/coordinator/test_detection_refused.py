"""A refused data port on a fake clock: after the coordinator's own control connection to a
device closed, a refusal on its data port (no process listens) makes it lost at once, without
waiting out the flap grace; a refusal without that close, after the device was heard from, or
about a device outside the plan changes nothing, and a close alone still waits out the grace."""

from __future__ import annotations

from common.ids import DeviceId
from common.messages import RoundDone
from services.coordinator import core, detection
from services.coordinator.core import Beats, Log, Lost, Refused, SendProbe, Tick
from services.coordinator.membership import on_heartbeat
from tests.coordinator.test_detection_signals import (
    GRACE_S,
    B,
    closed,
    hb,
    members,
    of,
    peer_closed,
    run,
    wait,
)


def test_a_close_then_a_refused_port_is_lost_at_once_naming_both():
    w, out = run(wait(), [(0.50, closed(0.50)), (0.51, Refused(B, 0.51))])
    assert not of(Lost, out) and B in w.suspects  # the core decides at its tick
    w, out = run(w, [(0.55, Tick())])
    (lost,) = of(Lost, out)
    assert not of(SendProbe, out)
    assert lost.devices == [B]  # at 0.55, well within the grace (over at 0.80)
    assert lost.reason == (
        "workers ['b'] lost while the coordinator waited for RoundDone of round 7: "
        "b: control connection closed 0.05 s ago; its data port refused a connection: "
        "no process listens"
    )
    assert w.done and B not in w.suspects


def test_a_refusal_without_a_close_changes_nothing():
    w, out = run(wait(), [(0.5, Refused(B, 0.5)), (0.6, Tick()), (5.0, Tick())])
    assert not of(Lost, out) and not of(SendProbe, out) and w.suspects == {}
    (note,) = [c for c in of(Log, out) if c.event == "data port refused a connection"]
    assert note.level == "debug" and note.fields["ignored"] == "it is not a suspect"


def test_a_neighbours_close_is_not_enough_for_a_refusal():
    """Only the coordinator's own socket seeing the close makes its port's refusal count."""
    w, out = run(wait(), [(0.5, peer_closed(0.5)), (0.51, Refused(B, 0.51)), (0.6, Tick())])
    assert not of(Lost, out) and B in w.suspects


def test_a_refusal_begun_before_the_close_changes_nothing():
    w, out = run(wait(), [(0.5, closed(0.5)), (0.5, Refused(B, 0.4)), (0.6, Tick())])
    assert not of(Lost, out)
    w, out = run(w, [(0.51 + GRACE_S, Tick())])  # the grace decides, as before
    (lost,) = of(Lost, out)
    assert lost.reason.endswith(f"not back within the {GRACE_S:.2f} s grace")


def test_a_device_heard_from_after_the_check_began_is_not_lost():
    """A worker restarted on the same port heartbeats: the refusal it outlived is stale."""
    back = on_heartbeat(members(), hb(B), 0.6)
    w, out = run(
        wait(),
        [(0.5, closed(0.5)), (0.6, Beats(back)), (0.65, Refused(B, 0.55)), (0.7, Tick())],
    )
    assert not of(Lost, out) and w.suspects == {}
    w, out = run(w, [(5.0, Tick())])
    assert not of(Lost, out) and not w.done


def test_a_refusal_then_a_heartbeat_before_the_tick_is_no_loss():
    back = on_heartbeat(members(), hb(B), 0.7)
    w, out = run(
        wait(), [(0.5, closed(0.5)), (0.55, Refused(B, 0.55)), (0.7, Beats(back)), (0.7, Tick())]
    )
    assert not of(Lost, out) and not w.done


def test_a_close_without_a_refusal_waits_out_the_grace_as_before():
    w, out = run(wait(), [(0.5, closed(0.5)), (0.49 + GRACE_S, Tick())])
    assert not of(Lost, out)
    _w, out = run(w, [(0.51 + GRACE_S, Tick())])
    (lost,) = of(Lost, out)
    assert lost.reason.endswith(f"not back within the {GRACE_S:.2f} s grace")


def test_a_refusal_about_a_device_outside_the_plan_changes_nothing():
    x = DeviceId("x")
    w, out = run(wait(), [(0.5, closed(0.5, x)), (0.51, Refused(x, 0.51)), (0.6, Tick())])
    assert not of(Lost, out) and w.suspects == {}
    assert all(c.level == "debug" for c in of(Log, out))


def test_between_steps_a_refusal_is_kept_for_the_next_wait():
    among = frozenset(members())
    suspects, _ = core.signalled({}, members(), closed(0.5), among, 4, GRACE_S, 0.5)
    suspects, logs = core.signalled(suspects, members(), Refused(B, 0.52), among, 4, GRACE_S, 0.52)
    assert [log.level for log in logs] == ["warning"]
    assert detection.port_refused(suspects, members(), among) == [B]
    w = core.begin(
        RoundDone,
        sorted(among),
        4,
        8,
        0.6,
        timeout_s=60.0,
        heartbeat_deadline_s=30.0,
        probe_timeout_s=0.2,
        members=members(),
        suspects=suspects,
        flap_grace_s=GRACE_S,
    )
    _w, out = run(w, [(0.61, Tick())])
    assert [lost.devices for lost in of(Lost, out)] == [[B]]


def test_the_refused_signal_reads_plainly():
    assert detection.Signal(1.0, detection.COORDINATOR, "refused").text(2.0) == (
        "its data port refused a connection"
    )
