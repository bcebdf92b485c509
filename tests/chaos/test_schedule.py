"""The seeded chaos schedule: reproducible, and every constraint holds for many seeds."""

from __future__ import annotations

import pytest

from tests.chaos.backend import KINDS, REMOVING, Kind
from tests.chaos.schedule import Event, Schedule, check, draw

LOOPBACK: list[Kind] = [k for k in KINDS if k != "cut_restore"]


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    one = draw(7, 8, LOOPBACK, initial_devices=5, need=2)
    assert one == draw(7, 8, LOOPBACK, initial_devices=5, need=2)
    assert one != draw(8, 8, LOOPBACK, initial_devices=5, need=2)


@pytest.mark.parametrize(
    ("events", "kinds", "devices", "need"),
    [(7, LOOPBACK, 5, 2), (30, list(KINDS), 5, 2), (25, list(KINDS), 6, 3), (6, LOOPBACK, 3, 1)],
)
def test_every_constraint_holds_for_many_seeds(
    events: int, kinds: list[Kind], devices: int, need: int
) -> None:
    for seed in range(200):
        schedule = draw(seed, events, kinds, initial_devices=devices, need=need)
        assert len(schedule.events) == events
        assert check(schedule) == [], (seed, [e.kind for e in schedule.events])
        assert min(schedule.live_after()) >= need
        assert {e.kind for e in schedule.events} <= set(kinds)
        for event in schedule.events:
            assert (event.hold_s > 0) == (event.kind in ("stop_cont", "cut_restore"))
            assert bool(event.new_device) == (event.kind == "join")
        joiners = [e.new_device for e in schedule.events if e.kind == "join"]
        assert joiners == [f"j{i}" for i in range(1, len(joiners) + 1)]


def test_a_long_schedule_draws_every_kind_and_a_second_failure_follows_a_first() -> None:
    for seed in range(50):
        schedule = draw(seed, 30, KINDS, initial_devices=6, need=2)
        kinds = [e.kind for e in schedule.events]
        assert set(kinds) == set(KINDS), (seed, kinds)
        seconds = [i for i, k in enumerate(kinds) if k == "second_kill"]
        assert all(kinds[i - 1] in ("kill", "kill_stage") for i in seconds)


def test_only_the_backends_kinds_are_drawn() -> None:
    schedule = draw(3, 12, ["kill", "join"], initial_devices=3, need=2)
    assert {e.kind for e in schedule.events} <= {"kill", "join"}
    assert check(schedule) == []


def test_nothing_to_draw_is_an_error_not_a_schedule_that_stops_the_job() -> None:
    with pytest.raises(ValueError, match="nothing can be drawn"):
        draw(1, 3, ["kill"], initial_devices=3, need=2)
    with pytest.raises(ValueError, match="the job needs"):
        draw(1, 3, ["kill"], initial_devices=1, need=2)


def test_check_names_every_broken_constraint() -> None:
    events = (
        Event(0, "second_kill", 0, 1),
        Event(1, "kill_stage", 0, 1),
        Event(2, "redis_restart", 0, 1),
        Event(3, "coordinator_restart", 0, 1),
        Event(4, "stop_cont", 0, 1),
    )
    problems = check(Schedule(1, events, initial_devices=4, need=2))
    text = "\n".join(problems)
    assert "#0 second_kill" in text and "does not follow a failure" in text
    assert "#2 redis_restart" in text and "directly follows a failure" in text
    assert "restarts #2 and #3" in text
    assert "#4 stop_cont" in text and "has no hold" in text
    assert "1 live, the job needs 2" in text  # 4 - 1 - 2 = 1 after the stage
    assert REMOVING["kill_stage"] == 2


def test_the_job_is_long_enough_for_every_event() -> None:
    schedule = draw(2, 7, LOOPBACK, initial_devices=5, need=2)
    assert schedule.rounds_needed() >= sum(e.gap_rounds for e in schedule.events) + 10 * 7
