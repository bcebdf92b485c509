"""Metrics records to CSV cells and TensorBoard points: the pure conversion."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.metrics_export import (
    FIRST,
    MAX_DEPTH,
    Scalar,
    cell,
    columns,
    flatten,
    resume_point,
    row,
    scalars,
)

ROUND = {
    "round": 3,
    "epoch": 1,
    "loss": 2.25,
    "accuracy": 0.125,
    "round_s": 0.5,
    "samples_per_s": 64.0,
    "time": 1_700_000_000.25,
    "devices": {
        "a": {"stage": 0, "max_alive": 2, "forward_s": 0.1},
        "b": {"stage": 1, "max_alive": 1, "forward_s": 0.2},
    },
}
EVAL = {
    "round": 3,
    "eval_loss": 2.0,
    "eval_accuracy": 0.25,
    "eval_samples": 100,
    "time": 1_700_000_001.5,
}


def test_nested_fields_become_one_column_each_named_by_their_path():
    flat = flatten(ROUND)
    assert flat["devices/a/forward_s"] == 0.1
    assert flat["devices/b/stage"] == 1
    assert "devices" not in flat
    assert flat["loss"] == 2.25


def test_lists_and_deep_nesting_stay_one_json_cell():
    deep: dict[str, object] = {"x": 1}
    for name in "edcba":
        deep = {name: deep}
    flat = flatten({"round": 0, "tags": [1, 2], "deep": deep})
    assert json.loads(flat["tags"]) == [1, 2]
    (name,) = (k for k in flat if k.startswith("deep"))
    assert name.count("/") == MAX_DEPTH - 1  # cut off at MAX_DEPTH levels, the rest as JSON
    assert json.loads(flat[name]) == {"d": {"e": {"x": 1}}}


@given(st.floats(allow_nan=False))
def test_a_float_cell_reads_back_to_the_same_float(value):
    assert float(cell(value)) == value


def test_cells_of_other_values():
    assert cell(None) == ""
    assert cell(True) == "true"
    assert cell(7) == "7"
    assert cell(math.nan) == "nan"
    assert cell("nano-1") == "nano-1"


@pytest.mark.parametrize("text", ["=cmd|' /C calc'!A0", "+1", "-2+3", "@SUM(A1)", "\tx"])
def test_text_a_spreadsheet_would_run_is_made_inert(text):
    assert cell(text) == "'" + text


def test_a_row_leaves_out_empty_cells():
    assert row({"round": 1, "note": None, "loss": 0.5}) == {"round": "1", "loss": "0.5"}


def test_columns_lead_with_the_known_fields_then_flat_then_nested_by_name():
    names = [*flatten(ROUND), *flatten(EVAL)]
    got = columns(names)
    assert got[:3] == ["round", "time", "epoch"]
    known = [n for n in got if n in FIRST]
    assert known == [n for n in FIRST if n in names]
    nested = got[len(known) :]
    assert nested == sorted(nested) and all("/" in n for n in nested)
    assert len(got) == len(set(names))


@given(st.lists(st.sampled_from([*FIRST, "zeta", "a/b", "a/c/d", "b", "devices/x/y"])))
def test_column_order_depends_only_on_which_columns_there_are(names):
    shuffled = list(names)
    random.Random(len(names)).shuffle(shuffled)
    assert columns(names) == columns(shuffled) == columns(set(names))


def test_scalars_are_the_numeric_fields_at_the_round_and_the_record_time():
    got = {s.tag: s for s in scalars(ROUND)}
    assert set(got) == {
        "epoch",
        "loss",
        "accuracy",
        "round_s",
        "samples_per_s",
        *(f"devices/{d}/{k}" for d in "ab" for k in ("stage", "max_alive", "forward_s")),
    }
    assert got["loss"] == Scalar("loss", 3, 2.25, 1_700_000_000.25)
    assert {s.step for s in got.values()} == {3}


def test_text_and_flags_are_not_scalars():
    got = scalars({"round": 0, "time": 1.0, "ok": True, "who": "a", "n": 2})
    assert [s.tag for s in got] == ["n"]


def test_a_record_without_time_takes_the_one_given_and_without_round_has_no_points():
    assert scalars({"round": 2, "loss": 1.0}, wall_time=5.0) == [Scalar("loss", 2, 1.0, 5.0)]
    assert scalars({"round": 2, "loss": 1.0}) == []
    assert scalars({"loss": 1.0, "time": 5.0}) == []
    assert scalars({"round": "2", "loss": 1.0, "time": 5.0}) == []


def test_resume_goes_on_after_the_rows_that_match_the_first_records():
    records = [ROUND, EVAL, {**ROUND, "round": 4}]
    written = [row(r) for r in records[:2]]
    # a wider header read back gives empty cells for the columns a row lacks
    padded = [{**{c: "" for c in columns(k for r in written for k in r)}, **r} for r in written]
    assert resume_point(padded, records) == 2
    assert resume_point([], records) == 0
    assert resume_point([row(r) for r in records], records) == 3


def test_resume_starts_over_when_the_rows_disagree():
    records = [ROUND, {**ROUND, "round": 4}]
    assert resume_point([row({**ROUND, "time": 1.0})], records) is None  # another run's file
    assert resume_point([row(r) for r in records], records[:1]) is None  # more rows than records
    cut = dict(row(ROUND))
    cut["devices/b/stage"] = None  # type: ignore[assignment]  # a row cut short by a crash
    assert resume_point([cut], records) is None
