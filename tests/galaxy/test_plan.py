"""InferencePlan: field consistency, per-mode totals and the index ranges each device owns."""

import pytest
from pydantic import ValidationError

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan

CONFIG = TransformerConfig("encoder", 2, 64, 4, 256, 100, 64, 1e-12)


def _plan(**kw):
    base = {
        "mode": "galaxy",
        "devices": ["a", "b", "c"],
        "heads": [2, 1, 1],
        "cols": [128, 64, 64],
        "rows": [6, 5, 5],
        "seq_len": 16,
        "overlap": True,
    }
    return InferencePlan(**{**base, **kw})


def test_galaxy_ranges_tile_each_dimension_in_ring_order():
    plan = _plan()
    plan.check(CONFIG)
    assert [plan.head_range(i) for i in range(3)] == [range(0, 2), range(2, 3), range(3, 4)]
    assert [plan.col_range(i) for i in range(3)] == [
        range(0, 128),
        range(128, 192),
        range(192, 256),
    ]
    assert [plan.row_range(i) for i in range(3)] == [range(0, 6), range(6, 11), range(11, 16)]


def test_replicated_modes_give_every_device_the_whole_dimension():
    mlm = _plan(mode="megatron", rows=[16, 16, 16], overlap=False)
    mlm.check(CONFIG)
    assert [mlm.row_range(i) for i in range(3)] == [range(16)] * 3
    assert mlm.head_range(1) == range(2, 3)
    sp = _plan(mode="sp", heads=[4, 4, 4], cols=[256] * 3, overlap=False)
    sp.check(CONFIG)
    assert [sp.head_range(i) for i in range(3)] == [range(4)] * 3
    assert sp.col_range(2) == range(256)
    assert sp.row_range(2) == range(11, 16)
    local = InferencePlan(mode="local", devices=["a"], heads=[4], cols=[256], rows=[16], seq_len=16)
    local.check(CONFIG)
    assert (local.head_range(0), local.row_range(0)) == (range(4), range(16))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"heads": [3, 1, 1]}, "heads must sum to 4, got 5"),
        ({"cols": [128, 64, 63]}, "cols must sum to 256, got 255"),
        ({"rows": [6, 5, 4]}, "rows must sum to 16, got 15"),
        (
            {"mode": "megatron", "overlap": False},
            r"rows must be 16 on every device, got \[6, 5, 5\]",
        ),
        ({"mode": "sp", "overlap": False}, r"heads must be 4 on every device"),
        ({"seq_len": 65, "rows": [65, 0, 0]}, "seq_len 65 exceeds the model's max_positions 64"),
    ],
)
def test_check_names_field_expected_and_actual(kw, match):
    with pytest.raises(ConfigError, match=match):
        _plan(**kw).check(CONFIG)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"heads": [2, 2]}, "heads has 2 entries, expected 3"),
        ({"rows": [6, -1, 11]}, "rows must be >= 0"),
        ({"devices": ["a", "a", "b"]}, "unique"),
        ({"mode": "local"}, "exactly 1 device"),
        ({"mode": "sp"}, "overlap is a galaxy-mode"),
        ({"seq_len": "16"}, "valid integer"),
        ({"extra": 1}, "Extra inputs"),
    ],
)
def test_inconsistent_fields_are_refused(kw, match):
    with pytest.raises(ValidationError, match=match):
        _plan(**kw)


def test_plan_is_frozen_and_round_trips():
    plan = _plan()
    with pytest.raises(ValidationError):
        plan.seq_len = 3  # type: ignore[misc]
    assert InferencePlan.model_validate_json(plan.model_dump_json()) == plan
    with pytest.raises(ConfigError, match=r"device index must be in \[0, 3\), got 3"):
        plan.head_range(3)
