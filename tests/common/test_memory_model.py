"""The memory model's byte counts, and which device backs up which stage's replica."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.ids import DeviceId
from common.memory_model import LayerMemory, replica_bytes, stage_bytes
from common.plan import Plan

# three layers: weights 100, 20, 3; optimizer state 200, 40, 6; activations 7, 11, 13
LAYERS = LayerMemory.of([100, 20, 3], [200, 40, 6], [7, 11, 13])


def plan_of(*groups: list[str]) -> Plan:
    """One layer per stage, each stage run by `groups[i]`."""
    return Plan.model_validate(
        {
            "global_batch": 8,
            "microbatches": 2,
            "stages": [
                {"start": i, "end": i + 1, "devices": [{"device": d} for d in devs]}
                for i, devs in enumerate(groups)
            ],
        }
    )


def test_a_replica_is_weights_plus_optimizer_state_of_its_layers() -> None:
    assert replica_bytes(120, 240) == 360
    assert LAYERS.replica(0, 3) == 123 + 246
    assert LAYERS.replica(1, 3) == 23 + 46
    assert LAYERS.replica(1, 2) == 60
    assert LAYERS.replica(2, 2) == 0


def test_a_replica_keeps_no_gradients_or_activations() -> None:
    # the stage itself: 2 x 23 + 46 + (11 + 13) x 4 samples x 3 in flight = 380
    assert LAYERS.stage(1, 3, 4, 3) == 380
    assert stage_bytes(23, 46, 24, 4, 3) == 380
    assert LAYERS.stage(1, 3, 4, 3) - LAYERS.replica(1, 3) == 23 + 24 * 12


def test_byte_counts_must_describe_the_same_layers() -> None:
    with pytest.raises(ConfigError, match="byte counts for 2, 3 and 3 layers"):
        LayerMemory.of([1, 2], [1, 2, 3], [1, 2, 3])


def test_a_single_device_stage_backs_up_to_the_next_stage_and_the_last_to_the_first() -> None:
    plan = plan_of(["a"], ["b", "c"], ["d"], ["e"])
    assert [plan.backup_of(s) for s in range(4)] == ["b", None, "e", "a"]
    assert plan.backups_held(DeviceId("a")) == [3]
    assert plan.backups_held(DeviceId("b")) == [0]
    assert plan.backups_held(DeviceId("c")) == []
    assert plan.backups_held(DeviceId("d")) == []
    assert plan.backups_held(DeviceId("e")) == [2]


def test_two_single_devices_back_each_other_up() -> None:
    plan = plan_of(["a"], ["b"])
    assert (plan.backup_of(0), plan.backup_of(1)) == ("b", "a")


def test_a_one_stage_plan_and_multi_device_stages_back_up_nowhere() -> None:
    assert plan_of(["a"]).backup_of(0) is None
    assert plan_of(["a"]).backups_held(DeviceId("a")) == []
    plan = plan_of(["a", "b"], ["c", "d"])
    assert (plan.backup_of(0), plan.backup_of(1)) == (None, None)
