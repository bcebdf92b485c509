"""A worker's held stage state: snapshots by version, replicas and migrated layers from peers."""

from __future__ import annotations

import threading

import pytest

from common.errors import RoundAbortedError, RoundTimeoutError
from common.messages import LayerState
from services.worker.holdings import HeldLayer, Holdings, ReplicaSource

SRC = ReplicaSource(origin="b", start=2, end=4)


def _replica(layer: int, version: int = 3, epoch: int = 7, start: int = 2, end: int = 4):
    return LayerState(
        epoch=epoch, version=version, layer=layer, purpose="replica", start=start, end=end
    )


def _migrate(layer: int, epoch: int = 8) -> LayerState:
    return LayerState(epoch=epoch, version=5, layer=layer, purpose="migrate")


@pytest.fixture
def saved() -> list[tuple[ReplicaSource, int]]:
    return []


@pytest.fixture
def held(saved: list[tuple[ReplicaSource, int]]) -> Holdings:
    h = Holdings(1000, lambda src, v: saved.append((src, v)))
    h.reset(7, SRC)
    return h


def _snap(version: int) -> dict[int, HeldLayer]:
    return {layer: HeldLayer(blob=f"v{version}-l{layer}".encode()) for layer in (0, 1)}


def _blob(held: Holdings, version: int, layer: int) -> bytes | None:
    got = held.get(version, layer)
    return None if got is None else got.blob()


def test_snapshots_stay_for_the_versions_kept(held: Holdings) -> None:
    held.snapshot(4, _snap(4))
    held.snapshot(5, _snap(5))
    held.snapshot(6, _snap(6))
    held.keep_only({4, 6})
    assert _blob(held, 4, 1) == b"v4-l1" and _blob(held, 6, 0) == b"v6-l0"
    assert held.get(5, 0) is None and held.get(4, 2) is None
    assert held.versions() == {"own": [4, 6], "replica": []}


def test_a_replica_completes_once_every_layer_came_from_its_origin(
    held: Holdings, saved: list[tuple[ReplicaSource, int]]
) -> None:
    assert held.put(_replica(2), b"x2", "b") is None
    assert saved == []  # layer 3 still missing
    assert held.put(_replica(3), b"x3", "b") is None
    assert saved == [(SRC, 3)]
    assert _blob(held, 3, 2) == b"x2" and _blob(held, 3, 3) == b"x3"


@pytest.mark.parametrize(
    ("msg", "sender", "why"),
    [
        (_replica(2), "c", "replicas come from 'b', not from 'c'"),
        (_replica(2, epoch=6), "b", "plan epoch 6, current is 7"),
        (_replica(4, end=5), "b", "layer 4 of [2, 5) is not of the stage backed up here, [2, 4)"),
        (_replica(1, start=1), "b", "layer 1 of [1, 4) is not of the stage"),
    ],
)
def test_a_replica_from_anyone_or_anything_else_is_refused(
    held: Holdings, saved: list[tuple[ReplicaSource, int]], msg: LayerState, sender: str, why: str
) -> None:
    assert why in (held.put(msg, b"forged", sender) or "")
    assert held.get(msg.version, msg.layer) is None and saved == []


def test_a_device_that_backs_up_nothing_refuses_replicas() -> None:
    h = Holdings(1000, lambda *_: None)
    h.reset(7, None)
    assert h.put(_replica(2), b"x", "b") == "this device backs up no stage under the current plan"


def test_received_state_is_capped(held: Holdings) -> None:
    assert held.put(_replica(2), b"a" * 600, "b") is None
    why = held.put(_replica(3), b"a" * 600, "b")
    assert why == "600 bytes would take received state past its cap of 1000"


def test_migrated_layers_may_arrive_before_the_assignment_and_come_from_the_named_sender(
    held: Holdings,
) -> None:
    # epoch 8's layers arrive while this worker still runs epoch 7, one of them also forged
    assert held.put(_migrate(0), b"from-a", "a") is None
    assert held.put(_migrate(0), b"forged", "x") is None
    assert held.put(_migrate(1), b"from-c", "c") is None
    held.reset(8, None)
    got = held.take_migrated(8, {0: "a", 1: "c"}, 1.0, lambda: None)
    assert got == {0: b"from-a", 1: b"from-c"}


def test_migrated_layers_of_an_older_epoch_are_refused(held: Holdings) -> None:
    assert held.put(_migrate(0, epoch=6), b"x", "a") == "plan epoch 6 is older than the current 7"


def test_waiting_for_layers_that_never_come_names_them(held: Holdings) -> None:
    held.put(_migrate(0), b"x", "a")
    with pytest.raises(RoundTimeoutError, match=r"layers not received in 0 s: 1 from c"):
        held.take_migrated(8, {0: "a", 1: "c"}, 0.3, lambda: None)


def test_waiting_gives_up_when_told(held: Holdings) -> None:
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(RoundAbortedError, match="stopping"):
        held.take_migrated(8, {0: "a"}, 5.0, lambda: "stopping" if stop.is_set() else None)


def test_a_waiting_stage_takes_a_layer_as_it_arrives(held: Holdings) -> None:
    threading.Timer(0.1, lambda: held.put(_migrate(2), b"late", "d")).start()
    assert held.take_migrated(8, {2: "d"}, 5.0, lambda: None) == {2: b"late"}


def test_a_new_epoch_forgets_what_the_old_plan_held(held: Holdings) -> None:
    held.snapshot(3, {0: HeldLayer(blob=b"x")})
    held.put(_replica(2), b"y", "b")
    held.reset(8, None)
    assert held.versions() == {"own": [], "replica": []}


def test_own_snapshots_are_not_counted_against_the_cap(held: Holdings) -> None:
    held.snapshot(3, {0: HeldLayer(blob=b"a" * 900)})
    assert held.put(_replica(2), b"a" * 900, "b") is None
    assert held.put(_replica(3), b"a" * 101, "b") == (
        "101 bytes would take received state past its cap of 1000"
    )
