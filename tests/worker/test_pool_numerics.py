"""The pool refuses a plan member's poisoned part and fails the round naming it.

Non-finite activations, gradients and reduce chunks, and labels the loss cannot
index, from the very device the plan names: each is refused with a reason that
names the peer and what was wrong, and every wait of the round then fails at
once with a PeerDataError (instead of training on it, or waiting out the task
timeout for a part that will never come). The same values from a device the
plan does not name are refused as before and fail nothing. The checks' own
helpers are tested against values computed the plain way.
"""

from __future__ import annotations

import threading

import pytest
import torch

from common.errors import NonFiniteError, PeerDataError, RoundTimeoutError
from common.messages import Activation, Gradient, ReduceChunk
from services.worker.numerics import (
    PAST_END,
    describe_nonfinite,
    label_fault,
    part_fault,
    require_finite,
)
from services.worker.pool import Expected, TaskPool

CLASSES = 10
SPAN = (0, 8)
EXPECT = Expected(
    activations={(0, 5): "a", (5, 8): "b"},
    gradients={(0, 4): "d", (4, 8): "e"},
    ring_prev="g",
    ring_size=2,
    microbatches=4,
    num_classes=CLASSES,
)
WAIT_S = 30.0
"""A bound no passing test comes near: a poisoned round's waits fail at once."""


def pool_at(round_no: int = 0) -> TaskPool:
    pool = TaskPool()
    pool.reset(epoch=1, stage=1, span=SPAN, expected=EXPECT)
    pool.begin_round(round_no)
    return pool


def act(
    x: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    round_no: int = 0,
    lo: int = 0,
    hi: int = 5,
    phase: str = "train",
) -> tuple[Activation, list[torch.Tensor]]:
    msg = Activation(epoch=1, round=round_no, mb=0, stage=1, lo=lo, hi=hi, phase=phase)
    x = torch.zeros(hi - lo, 3) if x is None else x
    y = torch.arange(hi - lo, dtype=torch.int64) if y is None else y
    return msg, [x, y]


def grad(g: torch.Tensor, lo: int = 0, hi: int = 4) -> tuple[Gradient, list[torch.Tensor]]:
    return Gradient(epoch=1, round=0, mb=0, stage=1, lo=lo, hi=hi), [g]


def chunk(step: int = 0, index: int = 0) -> ReduceChunk:
    return ReduceChunk(epoch=1, round=0, stage=1, step=step, chunk=index)


def nan_at(shape: tuple[int, ...], value: float = float("nan")) -> torch.Tensor:
    t = torch.ones(shape)
    t.view(-1)[-1] = value
    return t


def waits_fail(pool: TaskPool) -> str:
    """The error a round's wait on `pool` raises now (the pool's ready set is never enough)."""
    with pytest.raises(PeerDataError) as info:
        pool.wait(lambda: None, WAIT_S, lambda: "a part that will never come")
    return str(info.value)


# --- the pool ---------------------------------------------------------------------


def test_nan_activations_from_the_plan_member_are_refused_and_fail_the_round():
    pool = pool_at()
    reason = pool.put_part(*act(nan_at((5, 3))), "a")
    assert reason is not None
    assert "from 'a'" in reason and "non-finite activations: 1 nan, 0 inf of 15 values" in reason
    assert "micro-batch 0, samples [0, 5), in round 0" in reason
    assert pool.resident_bytes() == 0 and pool.ready(0, "F") == frozenset()
    error = waits_fail(pool)
    assert error == f"refused {reason}"


def test_inf_gradients_are_refused_naming_the_next_stage_device():
    pool = pool_at()
    reason = pool.put_part(*grad(nan_at((4, 2), float("inf"))), "d")
    assert reason is not None and "gradients" in reason and "from 'd'" in reason
    assert "0 nan, 1 inf of 8 values" in reason
    assert "from 'd'" in waits_fail(pool)


def test_a_nan_reduce_chunk_fails_the_all_reduce_at_once():
    pool = pool_at()
    reason = pool.put_chunk(chunk(), nan_at((3,)), "g")
    assert reason is not None and "reduce chunk 0 of step 0 in round 0 from 'g'" in reason
    with pytest.raises(PeerDataError, match="from 'g'"):
        pool.take_chunk(0, 0, 0, timeout_s=WAIT_S)
    # not taken later either: the chunk never entered the pool
    assert pool.resident_bytes() == 0


@pytest.mark.parametrize(
    ("labels", "why"),
    [
        (torch.tensor([0, 1, 2, 3, 10**6]), "1 labels outside [0, 10) (e.g. 1000000)"),
        (torch.tensor([0, -1, 2, 3, 4]), "1 labels outside [0, 10) (e.g. -1)"),
        (torch.tensor([0, 1, 2, 3, CLASSES]), "outside [0, 10) (e.g. 10)"),
        (torch.tensor([PAST_END, 1, 2, 3, 4]), "outside [0, 10) (e.g. -100)"),  # train: no
        (torch.zeros(5), "labels of dtype torch.float32, want torch.int64"),
        (torch.zeros(5, dtype=torch.int32), "labels of dtype torch.int32"),
        (torch.zeros(4, dtype=torch.int64), "labels of shape (4,), want (5,)"),
        (torch.zeros(5, 2, dtype=torch.int64), "labels of shape (5, 2), want (5,)"),
    ],
)
def test_labels_the_loss_cannot_index_are_refused(labels, why):
    pool = pool_at()
    reason = pool.put_part(*act(y=labels), "a")
    assert reason is not None and why in reason and "from 'a'" in reason
    assert "from 'a'" in waits_fail(pool)


def test_good_parts_pass_and_evaluation_may_carry_the_past_end_label():
    pool = pool_at()
    y = torch.tensor([0, CLASSES - 1, 3, 3, 7])
    assert pool.put_part(*act(y=y), "a") is None
    assert pool.put_part(*act(lo=5, hi=8), "b") is None
    assert pool.ready(0, "F") == {0}
    # held-out positions past the data's end: only evaluation parts may carry PAST_END
    past = torch.tensor([1, 2, PAST_END, PAST_END, PAST_END])
    assert pool.put_part(*act(y=past, round_no=1, phase="eval"), "a") is None
    assert pool.put_part(*grad(torch.randn(4, 2)), "d") is None
    assert pool.put_chunk(chunk(), torch.randn(3), "g") is None
    assert pool.fault is None and pool.dropped == 0


def test_the_same_poison_from_a_non_member_fails_nothing():
    pool = pool_at()
    reason = pool.put_part(*act(nan_at((5, 3))), "intruder")
    assert reason is not None and "not from 'intruder'" in reason
    assert pool.put_chunk(chunk(), nan_at((3,)), "intruder") is not None
    assert pool.fault is None
    assert pool.put_part(*act(), "a") is None  # the member's good part still counts
    with pytest.raises(RoundTimeoutError):
        pool.wait(lambda: None, 0.01, lambda: "nothing")


def test_a_waiting_round_wakes_up_at_the_poisoned_part():
    pool = pool_at()
    errors: list[BaseException] = []
    started = threading.Event()

    def round_waits() -> None:
        started.set()
        try:
            pool.wait(lambda: pool.ready(0, "F") or None, WAIT_S, lambda: "activations")
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    waiter = threading.Thread(target=round_waits)
    waiter.start()
    started.wait(WAIT_S)
    pool.put_part(*act(nan_at((5, 3))), "a")
    waiter.join(WAIT_S)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PeerDataError), errors
    assert "from 'a'" in str(errors[0])


def test_the_fault_outlives_the_round_until_the_next_assignment():
    pool = pool_at()
    # a part of the next round may arrive first: its poison fails that round too
    pool.put_part(*act(nan_at((5, 3)), round_no=1), "a")
    first = pool.fault
    assert first is not None and "in round 1" in first
    pool.put_part(*grad(nan_at((4, 2))), "d")  # a second fault does not replace the first
    pool.begin_round(1)
    assert pool.fault == first
    assert "in round 1 from 'a'" in waits_fail(pool)
    pool.reset(epoch=2, stage=1, span=SPAN, expected=EXPECT)
    assert pool.fault is None


# --- the checks ---------------------------------------------------------------------


def test_describe_nonfinite_counts_nan_and_inf_the_plain_way():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), float("nan"), 2.0])
    plain_nan = sum(1 for v in t.tolist() if v != v)
    plain_inf = sum(1 for v in t.tolist() if v in (float("inf"), -float("inf")))
    assert describe_nonfinite(t) == f"{plain_nan} nan, {plain_inf} inf of 6 values"
    assert describe_nonfinite(torch.randn(4, 4)) is None
    assert describe_nonfinite(torch.tensor([10**9])) is None  # integers are finite
    assert describe_nonfinite(torch.tensor([1.0, float("inf")], dtype=torch.float16)) == (
        "0 nan, 1 inf of 2 values"
    )


def test_label_and_part_faults():
    assert label_fault(torch.tensor([0, 9]), 2, 10, evaluation=False) is None
    assert label_fault(torch.tensor([PAST_END, 9]), 2, 10, evaluation=True) is None
    assert "e.g. -100" in (label_fault(torch.tensor([PAST_END, 9]), 2, 10, False) or "")
    assert "e.g. -7" in (label_fault(torch.tensor([-7, 9]), 2, 10, evaluation=True) or "")
    assert part_fault("F", [torch.zeros(2, 3)], 2, 10) == "activations without labels"
    assert part_fault("F", [torch.zeros(2, 3), torch.tensor([0, 10])], 2, None) is None
    assert part_fault("B", [torch.zeros(2, 3)], 2, 10) is None


def test_require_finite_names_the_first_bad_tensor():
    ok = ("w", torch.ones(3))
    require_finite([ok], "the weights")
    with pytest.raises(NonFiniteError, match=r"^the weights \(0.fc.bias\) is not finite: 1 nan"):
        require_finite([ok, ("0.fc.bias", nan_at((2,)))], "the weights")
    with pytest.raises(NonFiniteError, match=r"^the loss of micro-batch 1 is not finite: 0 nan"):
        require_finite([("", torch.tensor(float("inf")))], "the loss of micro-batch 1")
