from common.messages import Heartbeat
from services.coordinator.membership import (
    Rules,
    Verdict,
    admit,
    dead,
    expired,
    forget,
    on_heartbeat,
    unassigned,
)


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


# --- what a heartbeat may cost: Redis writes, expiry, the cap (a fake clock) ---------

RULES = Rules(write_every_s=1.0, expiry_s=10.0, max_unassigned=3)


def beat(state, device, now, keep=()):
    return admit(state, hb(device), now, RULES, keep)


def test_first_heartbeat_is_written_at_once_then_at_most_once_a_second():
    state, verdict = beat({}, "a", 0.0)
    assert verdict is Verdict.JOINED and state["a"].written == 0.0
    verdicts = []
    for i in range(1, 50_000):  # a flood: 50,000 heartbeats in 2.5 s
        state, v = beat(state, "a", i * 5e-5)
        verdicts.append(v)
    writes = [i for i, v in enumerate(verdicts, 1) if v is Verdict.WRITE]
    assert writes == [20_000, 40_000]  # at 1.0 s and 2.0 s
    assert verdicts.count(Verdict.LIMITED) == 49_999 - 2
    assert state["a"].beats == 50_000 and state["a"].last_seen == 49_999 * 5e-5
    assert state["a"].written == 2.0


def test_a_quiet_device_is_written_on_every_heartbeat():
    state, _ = beat({}, "a", 0.0)
    for now in (1.0, 2.5, 3.5):
        state, verdict = beat(state, "a", now)
        assert verdict is Verdict.WRITE and state["a"].written == now


def test_new_ids_beyond_the_cap_are_dropped_and_known_ones_still_counted():
    state: dict = {}
    for i in range(3):
        state, verdict = beat(state, f"fake-{i}", 0.0)
        assert verdict is Verdict.JOINED
    dropped, verdict = beat(state, "fake-3", 0.1)
    assert verdict is Verdict.DROPPED and dropped is state and "fake-3" not in dropped
    state, verdict = beat(state, "fake-0", 1.5)  # a known id is never dropped
    assert verdict is Verdict.WRITE and unassigned(state) == 3


def test_kept_devices_join_past_the_cap_and_do_not_count_against_it():
    keep = {"a", "b"}
    state: dict = {}
    for i in range(3):
        state, _ = beat(state, f"fake-{i}", 0.0, keep)
    state, verdict = beat(state, "a", 0.0, keep)
    assert verdict is Verdict.JOINED
    state, verdict = beat(state, "b", 0.0, keep)
    assert verdict is Verdict.JOINED
    assert unassigned(state, keep) == 3 and len(state) == 5
    assert beat(state, "fake-9", 0.0, keep)[1] is Verdict.DROPPED


def test_silent_devices_expire_unless_kept_and_forgetting_frees_the_cap():
    state: dict = {}
    for i in range(3):
        state, _ = beat(state, f"fake-{i}", float(i))
    state, _ = beat(state, "a", 0.0, {"a"})
    assert expired(state, 10.0, 10.0) == []  # exactly the expiry time: still known
    assert expired(state, 10.5, 10.0) == ["a", "fake-0"]
    assert expired(state, 10.5, 10.0, keep={"a"}) == ["fake-0"]
    assert expired(state, 100.0, 10.0, keep={"a"}) == ["fake-0", "fake-1", "fake-2"]
    after = forget(state, expired(state, 11.5, 10.0, keep={"a"}))
    assert sorted(after) == ["a", "fake-2"] and len(state) == 4  # pure
    after, verdict = beat(after, "new", 11.5)
    assert verdict is Verdict.JOINED


def test_a_forgotten_device_that_comes_back_joins_again():
    state, _ = beat({}, "a", 0.0)
    state = forget(state, expired(state, 20.0, 10.0))
    state, verdict = beat(state, "a", 20.0)
    assert verdict is Verdict.JOINED and state["a"].beats == 1
