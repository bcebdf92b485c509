"""A job's metrics records as CSV rows and TensorBoard scalars, without any I/O.

A record is one entry of a job's `metrics` stream: a committed round (`round`,
`epoch`, `loss`, `accuracy`, `round_s`, `samples_per_s` and per-device timings
under `devices`) or an evaluation (`round`, `eval_loss`, `eval_accuracy`,
`eval_samples`), each with the wall-clock `time` it was recorded at. Nested
fields become one column (and one TensorBoard tag) each, named by their path:
`devices/nano-1/forward_s`. The streaming writer in the coordinator and
`asteroid export-metrics` both go through here, so what one writes while a job
trains is what the other writes afterwards, cell for cell.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SEP",
    "Scalar",
    "cell",
    "columns",
    "flatten",
    "resume_point",
    "row",
    "scalars",
]

SEP = "/"
"""Joins the path of a nested field: TensorBoard groups tags by their first part."""
MAX_DEPTH = 4
"""Nesting flattened into columns; anything deeper is kept as one JSON cell."""
FIRST = (
    "round",
    "time",
    "epoch",
    "loss",
    "accuracy",
    "eval_loss",
    "eval_accuracy",
    "eval_samples",
    "round_s",
    "samples_per_s",
)
"""Columns that lead, in this order, when present; the rest follow by depth, then name."""
NOT_SCALARS = frozenset({"round", "time"})
"""Fields that place a record (its step and wall time) rather than measure something."""
_FORMULA = ("=", "+", "-", "@", "\t", "\r")
"""How a text cell starts that a spreadsheet would run as a formula."""


@dataclass(frozen=True)
class Scalar:
    """One TensorBoard point: `tag` at `step` (the record's round), recorded at `wall_time`."""

    tag: str
    step: int
    value: float
    wall_time: float


def flatten(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's leaves by path (`devices/a/forward_s`); lists and deep nesting as JSON text.

    Keys are taken as text whatever they were, so a device's name cannot turn
    into anything but part of a column name.
    """
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any, depth: int) -> None:
        if isinstance(value, Mapping) and depth < MAX_DEPTH:
            for key, inner in value.items():
                walk(f"{prefix}{SEP}{key}" if prefix else str(key), inner, depth + 1)
        elif isinstance(value, Mapping | list | tuple):
            out[prefix] = json.dumps(value, sort_keys=True, default=str)
        else:
            out[prefix] = value

    walk("", record, 0)
    return out


def cell(value: Any) -> str:
    """The CSV text of one value: floats as Python writes them back exactly, text made inert.

    `repr` of a float is the shortest text that parses back to the same float,
    so a cell read with `float()` equals the value in Redis bit for bit. Text
    that a spreadsheet would run as a formula gets a leading `'`: a worker names
    its own device, and that name ends up in the file.
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    return "'" + text if text.startswith(_FORMULA) else text


def row(record: Mapping[str, Any]) -> dict[str, str]:
    """The record's non-empty cells by column name."""
    cells = {name: cell(value) for name, value in flatten(record).items()}
    return {name: text for name, text in cells.items() if text}


def _order(name: str) -> tuple[int, int, str]:
    rank = FIRST.index(name) if name in FIRST else len(FIRST)
    return rank, name.count(SEP), name


def columns(names: Iterable[str]) -> list[str]:
    """Every column in `names` once, in an order that depends only on which columns there are.

    The known fields lead (round first: it is the step), then the other
    top-level ones, then the nested ones, each by name; so a file written a
    round at a time and one written at once get the same header.
    """
    return sorted(set(names), key=_order)


def scalars(record: Mapping[str, Any], wall_time: float | None = None) -> list[Scalar]:
    """The numeric fields of `record` as TensorBoard points at its round.

    `wall_time` stands in for a record without its own `time` (written by an
    older coordinator). A record without an integer round has no step, so no
    points; non-finite values are kept (TensorBoard shows them as gaps).
    """
    step = record.get("round")
    when = record.get("time", wall_time)
    if not isinstance(step, int) or isinstance(step, bool):
        return []
    if not isinstance(when, int | float) or isinstance(when, bool) or not math.isfinite(when):
        return []
    return [
        Scalar(tag, step, float(value), float(when))
        for tag, value in flatten(record).items()
        if tag not in NOT_SCALARS and isinstance(value, int | float) and not isinstance(value, bool)
    ]


def resume_point(
    written: Sequence[Mapping[str, str]], records: Sequence[Mapping[str, Any]]
) -> int | None:
    """How many of `records` the rows already `written` hold, or None if they disagree.

    A restarted writer appends the records after that point. The rows must be
    exactly the first records (empty cells ignored, since a later column adds
    them to earlier rows); anything else (a job replaced under the same id, a
    row cut short when the process died mid-write, more rows than records) means
    the file is rewritten from the records.
    """
    if len(written) > len(records):
        return None
    for have, record in zip(written, records, strict=False):
        if {k: v for k, v in have.items() if v} != row(record):
            return None
    return len(written)
