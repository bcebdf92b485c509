"""Evaluation parts in the task pool: kept apart from training, stale ones dropped."""

import torch

from common.messages import Activation
from services.worker.pool import TaskPool


def part(round_no, mb=0, lo=0, hi=4, phase="eval", epoch=2, stage=1):
    msg = Activation(epoch=epoch, round=round_no, mb=mb, stage=stage, lo=lo, hi=hi, phase=phase)
    return msg, [torch.full((hi - lo, 2), float(lo)), torch.arange(lo, hi)], "prev"


def pool_at(training_round=None):
    pool = TaskPool()
    pool.reset(epoch=2, stage=1, span=(0, 4))
    if training_round is not None:
        pool.begin_round(training_round)
    return pool


def test_eval_and_training_parts_of_the_same_round_and_microbatch_stay_apart():
    pool = pool_at(2)
    assert pool.put_part(*part(3, lo=0, hi=2)) is None
    assert pool.put_part(*part(3, lo=2, hi=4, phase="train")) is None
    # neither half completes the other's task
    assert pool.ready(3, "E") == frozenset() and pool.ready(3, "F") == frozenset()
    assert pool.put_part(*part(3, lo=2, hi=4)) is None
    assert pool.ready(3, "E") == {0} and pool.ready(3, "F") == frozenset()
    x, y = pool.take(3, "E", 0)
    assert y.tolist() == [0, 1, 2, 3] and x[:2].eq(0).all() and x[2:].eq(2).all()


def test_early_eval_parts_survive_begin_eval_older_ones_do_not():
    pool = pool_at(2)
    # the previous stage began evaluating round 3's weights before this worker did
    assert pool.put_part(*part(3, mb=5)) is None
    pool.begin_eval(3)
    assert pool.ready(3, "E") == {5}
    pool.begin_eval(4)  # a later evaluation: round 3's leftovers go
    assert pool.ready(3, "E") == frozenset()
    reason = pool.put_part(*part(3, mb=6))
    assert reason is not None and "evaluation of round 3 is over" in reason


def test_training_a_round_ends_the_evaluation_of_its_weights():
    pool = pool_at(2)
    pool.begin_eval(3)
    assert pool.put_part(*part(3, mb=1)) is None  # a duplicate nobody will take
    pool.begin_round(3)
    assert pool.ready(3, "E") == frozenset()
    assert "is over" in pool.put_part(*part(3, mb=2))
    assert "is over" in pool.put_part(*part(2, mb=0))
    assert pool.put_part(*part(4, mb=0)) is None  # weights of round 4 are next


def test_duplicate_misaddressed_and_old_epoch_eval_parts_are_dropped():
    pool = pool_at(0)
    pool.begin_eval(1)
    assert pool.put_part(*part(1)) is None
    assert "duplicate" in pool.put_part(*part(1))
    assert "overlapping" in pool.put_part(*part(1, lo=1, hi=3))
    assert "out-of-range" in pool.put_part(*part(1, mb=1, lo=2, hi=6))
    assert "epoch" in pool.put_part(*part(1, mb=2, epoch=1))
    assert "stage 2" in pool.put_part(*part(1, mb=2, stage=2))
    assert pool.dropped == 5
    assert pool.ready(1, "E") == {0}


def test_reset_forgets_the_evaluation():
    pool = pool_at(5)
    pool.begin_eval(6)
    pool.reset(epoch=3, stage=1, span=(0, 4))
    assert pool.eval_round == -1
    assert pool.put_part(*part(0, epoch=3)) is None
