"""When the links are measured again: slow communication, steady compute, with hysteresis."""

from __future__ import annotations

from common.ids import DeviceId
from common.messages import RoundDone, StageTimings
from services.coordinator.adapt import PERSIST, Speeds
from services.coordinator.link_drift import (
    COOLDOWN,
    CommWatch,
    comm_s,
    compute_ratio,
    observe,
    remeasured,
    replan_worth_it,
)

STEADY = Speeds(ema=(1.0,), base=(1.0,), rounds=10, drifting=0)
DRIFTING = Speeds(ema=(0.5,), base=(1.0,), rounds=10, drifting=1)


def _done(*waits: tuple[float, float]) -> dict[DeviceId, RoundDone]:
    return {
        DeviceId(f"d{i}"): RoundDone(
            device=DeviceId(f"d{i}"),
            epoch=1,
            round=0,
            stage=0,
            samples=1,
            timings=StageTimings(wait_s=w, allreduce_s=r),
        )
        for i, (w, r) in enumerate(waits)
    }


def _rounds(watch: CommWatch, n: int, took_s: float, speeds: Speeds = STEADY) -> CommWatch:
    for _ in range(n):
        watch = observe(watch, 0.1, _done((took_s, 0.0)), speeds)
    return watch


def test_communication_is_the_most_communicating_devices_waits_and_all_reduce():
    assert comm_s(_done((0.1, 0.2), (0.5, 0.0))) == 0.5
    assert comm_s({}) == 0.0


def test_slow_rounds_in_a_row_make_a_re_measurement_due():
    assert not _rounds(CommWatch(), PERSIST - 1, 1.0).due
    assert _rounds(CommWatch(), PERSIST, 1.0).due


def test_one_normal_round_resets_the_count():
    watch = _rounds(CommWatch(), PERSIST - 1, 1.0)
    watch = _rounds(watch, 1, 0.15)  # within the margin of the prediction
    assert watch.slow == 0 and not _rounds(watch, PERSIST - 1, 1.0).due


def test_drifting_compute_explains_slow_rounds():
    assert not _rounds(CommWatch(), PERSIST + 3, 1.0, DRIFTING).due


def test_tiny_predictions_do_not_make_noise_slow():
    watch = CommWatch()
    for _ in range(PERSIST + 3):
        watch = observe(watch, 0.001, _done((0.01, 0.0)), STEADY)  # 10x, but 9 ms
    assert not watch.due
    assert not _rounds(CommWatch(), PERSIST + 3, 1.0).cooldown
    assert observe(CommWatch(slow=5), 0.0, _done((9.0, 0.0)), STEADY) == CommWatch()


def test_after_a_re_measurement_it_cools_down_so_it_never_flaps():
    watch = remeasured()
    watch = _rounds(watch, COOLDOWN, 1.0)  # still slow: the links stayed slow
    assert not watch.due and watch.cooldown == 0
    assert _rounds(watch, PERSIST, 1.0).due  # only after the cool-down, and PERSIST rounds


def test_re_plan_only_for_a_gain_that_pays_for_the_migration():
    assert replan_worth_it(1.0, 0.5, remaining=100, migration_s=2.0)
    assert not replan_worth_it(1.0, 0.95, remaining=100, migration_s=2.0)  # below the gain
    assert not replan_worth_it(1.0, 0.5, remaining=2, migration_s=2.0)  # does not pay off


def test_a_stage_that_slows_down_at_once_explains_the_waits_before_the_smoothing_shows_it():
    jumped = Speeds(ema=(0.9,), base=(1.0,), rounds=10, drifting=0, last=(0.5,))
    assert jumped.slowed and not STEADY.slowed
    assert not _rounds(CommWatch(), PERSIST + 3, 1.0, jumped).due


def test_faster_compute_explains_no_longer_wait():
    faster = Speeds(ema=(1.5,), base=(1.0,), rounds=10, drifting=1, last=(2.0,))
    assert not faster.slowed
    assert _rounds(CommWatch(), PERSIST, 1.0, faster).due


def test_waits_that_slower_compute_explains_do_not_count():
    done = {
        d: m.model_copy(update={"timings": StageTimings(forward_s=1.5, backward_s=1.5, wait_s=1.0)})
        for d, m in _done((0.0, 0.0)).items()
    }
    assert compute_ratio(done, 1.0) == 3.0 and compute_ratio(done, 0.0) == 1.0
    assert compute_ratio(done, 10.0) == 1.0  # faster than predicted: the prediction stands
    watch = CommWatch()
    for _ in range(PERSIST + 3):
        watch = observe(watch, 0.4, done, STEADY, compute_s=1.0)  # 0.4 x 3 = 1.2 s expected
    assert not watch.due
    for _ in range(PERSIST):
        watch = observe(watch, 0.4, done, STEADY, compute_s=3.0)  # as fast as predicted
    assert watch.due
