"""A worker's evidence about its neighbours: who they are, what is reported, how often.

The pure parts (`services.worker.peer_watch`) on a fake clock, and the task
pool's neighbour timeout on a short real one (no timing is asserted: only
what is reported, and how many times).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

from common.messages import ReduceChunk
from common.plan import Plan
from services.worker.peer_watch import BURST, SPACING_S, LinkWatch, SilenceWatch, neighbours
from services.worker.pool import Expected, TaskPool


def _plan(*stages: list[str]) -> Plan:
    """One stage per list, its devices sharing its micro-batches equally; 8 layers."""
    n = len(stages)
    bounds = [round(i * 8 / n) for i in range(n + 1)]
    return Plan.model_validate(
        {
            "global_batch": 16,
            "microbatches": 2,
            "stages": [
                {"start": bounds[i], "end": bounds[i + 1], "devices": [{"device": d} for d in s]}
                for i, s in enumerate(stages)
            ],
        }
    )


# --- who a worker watches ----------------------------------------------------------


def test_neighbours_of_a_pipeline_are_the_adjacent_stages() -> None:
    plan = _plan(["a"], ["b"], ["c"])
    assert neighbours(plan, "a") == {"b"}
    assert neighbours(plan, "b") == {"a", "c"}
    assert neighbours(plan, "c") == {"b"}


def test_neighbours_follow_sample_ranges_and_the_ring() -> None:
    # stage 0 split a|b (samples [0,4) and [4,8)), stage 1 one device, stage 2 split d|e|f
    plan = _plan(["a", "b"], ["c"], ["d", "e", "f"])
    assert neighbours(plan, "a") == {"b", "c"}  # ring of two: b before and after
    assert neighbours(plan, "c") == {"a", "b", "d", "e", "f"}
    # e's samples [3, 6) come from c only; its ring is d before, f after
    assert neighbours(plan, "e") == {"c", "d", "f"}


def test_every_device_of_a_multi_device_plan_has_a_witness() -> None:
    plan = _plan(["a", "b"], ["c"], ["d", "e", "f"])
    for d in plan.devices:
        assert any(d in neighbours(plan, o) for o in plan.devices if o != d), d
    assert neighbours(_plan(["solo"]), "solo") == frozenset()
    assert neighbours(plan, "stranger") == frozenset()


# --- connections -------------------------------------------------------------------


def test_a_close_is_reported_once_and_a_return_after_it() -> None:
    watch = LinkWatch()
    watch.repoint(1, ["b", "c"])
    watch.connected("b")
    watch.connected("c")
    assert watch.due(0.0) == []  # a first connection is no news
    watch.closed("b")
    watch.closed("b")  # the retries that follow a close
    assert watch.due(0.1) == [("b", "disconnected")]
    watch.closed("b")
    assert watch.due(0.2) == []
    watch.connected("b")
    assert watch.due(0.3) == [("b", "reconnected")]
    assert watch.due(0.4) == []


def test_a_refused_first_connection_is_a_disconnect_and_strangers_are_ignored() -> None:
    watch = LinkWatch()
    watch.repoint(1, ["b"])
    watch.closed("b")  # dead before any data flowed
    watch.closed("zz")  # not a neighbour of this plan
    watch.connected("zz")
    assert watch.due(0.0) == [("b", "disconnected")]
    assert "zz" not in watch.links


def test_a_new_epoch_reports_a_neighbour_still_down_again() -> None:
    watch = LinkWatch()
    watch.repoint(1, ["b", "c"])
    watch.closed("b")
    assert watch.due(0.0) == [("b", "disconnected")]
    watch.repoint(1, ["b", "c"])  # the same plan once more: told stands
    assert watch.due(0.1) == []
    watch.repoint(2, ["b"])  # the coordinator runs epoch 2 now
    assert watch.due(0.2) == [("b", "disconnected")]
    assert watch.epoch == 2 and set(watch.links) == {"b"}


def test_a_flapping_link_is_reported_a_bounded_number_of_times_ending_on_its_state() -> None:
    watch = LinkWatch()
    watch.repoint(1, ["b"])
    watch.connected("b")
    reports: list[tuple[float, str]] = []
    now = 0.0
    for _ in range(10_000):  # a flap every millisecond, for ten seconds
        watch.closed("b")
        reports += [(now, how) for _, how in watch.due(now)]
        now += 0.0005
        watch.connected("b")
        reports += [(now, how) for _, how in watch.due(now)]
        now += 0.0005
    assert len(reports) <= BURST + now / SPACING_S + 1
    after_burst = [t for t, _ in reports[BURST:]]
    assert all(b - a >= SPACING_S for a, b in itertools.pairwise(after_burst))
    # the link ends down: the coordinator is told so once the spacing allows
    watch.closed("b")
    told = watch.due(now + SPACING_S)
    final = told[-1][1] if told else reports[-1][1]
    assert final == "disconnected"


# --- silence -----------------------------------------------------------------------


def test_silence_is_reported_after_the_timeout_once_per_round_and_peer() -> None:
    watch = SilenceWatch()
    watch.reset(3, 2.0)
    assert watch.deadline(10.0) == 12.0
    assert watch.due(("train", 5), 10.0, 11.9, ["b"]) == []
    assert watch.due(("train", 5), 10.0, 12.5, ["b", "c"]) == [("b", 2.5), ("c", 2.5)]
    assert watch.due(("train", 5), 10.0, 20.0, ["b", "c"]) == []  # still waiting: told once
    assert watch.due(("train", 5), 30.0, 33.0, ["b", "d"]) == [("d", 3.0)]  # a later wait
    assert watch.due(("eval", 5), 30.0, 33.0, ["b"]) == [("b", 3.0)]  # another phase
    assert watch.due(("train", 6), 40.0, 43.0, ["b"]) == [("b", 3.0)]  # the next round
    assert ("train", 5, "b") not in watch.told  # older rounds are forgotten
    watch.reset(4, None)
    assert watch.deadline(0.0) is None
    assert watch.due(("train", 6), 0.0, 1e9, ["b"]) == []


# --- the pool's waits --------------------------------------------------------------


def _ring_pool(timeout: float | None) -> tuple[TaskPool, list[tuple[int, str, float]]]:
    pool = TaskPool()
    expected = Expected(ring_prev="prev", ring_size=2, microbatches=2)
    pool.reset(7, 0, (0, 4), expected, from_round=0, peer_timeout_s=timeout)
    pool.begin_round(0)
    told: list[tuple[int, str, float]] = []
    pool.on_silent = lambda epoch, peer, waited: told.append((epoch, peer, waited))
    return pool, told


def _chunk(step: int) -> ReduceChunk:
    return ReduceChunk(epoch=7, round=0, stage=0, step=step, chunk=0)


def test_a_wait_past_the_neighbour_timeout_names_the_silent_peer_and_goes_on() -> None:
    pool, told = _ring_pool(0.05)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take_chunk(0, 0, 0, 30.0)))
    waiter.start()
    deadline = threading.Event()
    for _ in range(300):  # bounded: 30 s
        if told:
            break
        deadline.wait(0.1)
    assert [(e, p) for e, p, _ in told] == [(7, "prev")]
    assert told[0][2] >= 0.05
    assert waiter.is_alive()  # it keeps waiting for the coordinator to decide
    assert pool.put_chunk(_chunk(0), torch.ones(2), "prev") is None
    waiter.join(timeout=30)
    assert not waiter.is_alive() and torch.equal(got[0], torch.ones(2))
    # a second wait of the same round reports nothing new
    pool.put_chunk(_chunk(1), torch.ones(2), "prev")
    pool.take_chunk(0, 1, 0, 30.0)
    assert len(told) == 1


def test_without_a_neighbour_timeout_a_wait_reports_nothing() -> None:
    pool, told = _ring_pool(None)
    with pytest.raises(Exception, match="waited 0 s"):
        pool.take_chunk(0, 0, 0, 0.2)
    assert told == []


def test_a_failing_reporter_does_not_fail_the_wait() -> None:
    pool, _ = _ring_pool(0.01)

    def broken(*_: object) -> None:
        raise RuntimeError("control link gone")

    pool.on_silent = broken
    threading.Timer(0.3, lambda: pool.put_chunk(_chunk(0), torch.ones(2), "prev")).start()
    assert torch.equal(pool.take_chunk(0, 0, 0, 30.0), torch.ones(2))


def test_missing_names_the_senders_of_the_parts_not_yet_come() -> None:
    from common.messages import Activation

    pool = TaskPool()
    expected = Expected(activations={(0, 2): "x", (2, 4): "y"}, gradients={(0, 4): "z"})
    pool.reset(1, 1, (0, 4), expected)
    pool.begin_round(0)
    with pool.cond:
        assert pool.missing(0, "F", 0) == {"x", "y"}
        assert pool.missing(0, "B", 0) == {"z"}
    part = Activation(epoch=1, round=0, mb=0, stage=1, lo=0, hi=2)
    assert pool.put_part(part, [torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)], "x") is None
    with pool.cond:
        assert pool.missing(0, "F", 0) == {"y"}
        assert pool.missing(0, "F", 1) == {"x", "y"}
