"""Federation messages as decoded from the wire: every size a home chooses is bounded."""

from typing import Any

import pytest
from pydantic import ValidationError

from common.federation_messages import (
    MAX_FL_CLASSES,
    FederatedModel,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.job import MAX_HOMES
from common.messages import message_adapter

MODEL = {"name": "fl_cnn", "num_classes": 10, "options": {"channels": 1, "size": 8}}


def join(**changes: Any) -> dict[str, Any]:
    body = {
        "type": "join_federation",
        "federation": "fed-1",
        "home": 2,
        "model": MODEL,
        "num_samples": 6,
        "histogram": [1, 0, 5],
    }
    return {**body, **changes}


def update(**changes: Any) -> dict[str, Any]:
    body = {
        "type": "home_update",
        "federation": "fed-1",
        "home": 2,
        "round_id": 4,
        "num_samples": 6,
        "latency_s": 1.5,
    }
    return {**body, **changes}


def task(**changes: Any) -> dict[str, Any]:
    body = {"type": "federated_model", "federation": "fed-1", "home": 0, "status": "wait"}
    return {**body, **changes}


def test_good_messages_decode_to_their_types() -> None:
    msg = message_adapter.validate_python(join())
    assert isinstance(msg, JoinFederation)
    assert (msg.home, msg.num_samples, msg.histogram) == (2, 6, [1, 0, 5])
    assert isinstance(message_adapter.validate_python(update()), HomeUpdate)
    assert isinstance(message_adapter.validate_python(task(wait_s=60.0)), FederatedModel)
    fetch = {"type": "fetch_model", "federation": "fed-1", "home": MAX_HOMES - 1}
    assert isinstance(message_adapter.validate_python(fetch), FetchModel)
    big = join(num_samples=MAX_FL_CLASSES, histogram=[1] * MAX_FL_CLASSES)
    decoded = message_adapter.validate_python(big)
    assert isinstance(decoded, JoinFederation) and len(decoded.histogram) == MAX_FL_CLASSES


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"histogram": [1, 0, 4]}, "summing to num_samples \\(6\\), got a sum of 5"),
        ({"histogram": [7, -1, 0]}, "non-negative counts"),
        ({"histogram": []}, "at least 1 item"),
        (
            {"num_samples": MAX_FL_CLASSES + 1, "histogram": [1] * (MAX_FL_CLASSES + 1)},
            "at most 10000 items",
        ),
        ({"num_samples": 0, "histogram": [0]}, "greater than or equal to 1"),
        ({"home": -1}, "greater than or equal to 0"),
        ({"home": MAX_HOMES}, "less than 1000"),
        ({"federation": "a:b"}, "should match pattern"),
        ({"federation": "fed*"}, "should match pattern"),
        ({"federation": ".hidden"}, "should match pattern"),
        ({"federation": "x" * 65}, "should match pattern"),
        ({"extra": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_joins_are_refused(changes: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        message_adapter.validate_python(join(**changes))


@pytest.mark.parametrize(
    "latency", [float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 86_400.0 * 30 + 1]
)
def test_bad_latencies_are_refused(latency: float) -> None:
    with pytest.raises(ValidationError, match=r"home_update\.latency_s"):
        message_adapter.validate_python(update(latency_s=latency))


@pytest.mark.parametrize(
    "changes",
    [{"round_id": -1}, {"num_samples": 0}, {"home": MAX_HOMES}, {"federation": "a b"}],
)
def test_bad_updates_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=rf"home_update\.{next(iter(changes))}"):
        message_adapter.validate_python(update(**changes))


@pytest.mark.parametrize("wait_s", [0.0, 0.5, 60.0])
def test_wait_within_bounds_is_taken(wait_s: float) -> None:
    msg = message_adapter.validate_python(task(wait_s=wait_s))
    assert isinstance(msg, FederatedModel) and msg.wait_s == wait_s


@pytest.mark.parametrize(
    "changes",
    [
        {"wait_s": -0.1},
        {"wait_s": 60.5},
        {"status": "sleep"},
        {"round_id": -2},
        {"version": -1},
        {"home": -1},
    ],
)
def test_bad_tasks_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=rf"federated_model\.{next(iter(changes))}"):
        message_adapter.validate_python(task(**changes))
