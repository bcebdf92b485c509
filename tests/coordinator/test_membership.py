from common.messages import Heartbeat
from services.coordinator.membership import dead, on_heartbeat


def hb(device, **kw):
    return Heartbeat(device=device, data_addr="tcp://127.0.0.1:1", **kw)


def test_register_update_and_detect_dead():
    state = on_heartbeat({}, hb("a"), now=0.0)
    state = on_heartbeat(state, hb("b"), now=0.5)
    state = on_heartbeat(state, hb("a", round=3), now=2.0)
    assert state["a"].beats == 2 and state["a"].info.round == 3
    assert dead(state, now=2.1, interval_s=0.5, misses=3) == ["b"]
    assert dead(state, now=3.6, interval_s=0.5, misses=3) == ["a", "b"]
    assert dead(state, now=1.9, interval_s=0.5, misses=3) == []


def test_pure():
    state = on_heartbeat({}, hb("a"), now=0.0)
    on_heartbeat(state, hb("a"), now=5.0)
    assert state["a"].last_seen == 0.0
