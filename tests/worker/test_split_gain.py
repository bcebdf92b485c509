"""The split's measured gain: what it times, on which cores, and what it leaves behind."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from services.lib.split_gain import SplitGain, measure_split_gain, with_split_gain
from tests.planner.fixtures import layered_profile


def _net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(8, 32)


def test_the_gain_is_in_turn_over_split_minus_one() -> None:
    g = SplitGain(1.0, 2.0, in_turn_s=3.0, split_s=2.5, beta=1 / 3, cores=2, pinned=True)
    assert g.gain == pytest.approx(0.2)
    assert SplitGain(1.0, 2.0, 3.0, 3.6, 0.5, 1, False).gain == pytest.approx(-1 / 6)
    assert g.as_dict()["gain"] == pytest.approx(0.2)
    assert g.threads_gain == g.gain  # no single-thread figure: the one in-turn time
    assert g.best_threads == 2


def test_the_gain_weighs_the_split_against_the_faster_way_in_turn() -> None:
    slow_threads = SplitGain(1.0, 2.0, 4.0, 2.5, 1 / 3, 2, True, in_turn_one_s=2.0)
    assert slow_threads.threads_gain == pytest.approx(0.6)
    assert slow_threads.gain == pytest.approx(-0.2)  # one thread unsplit beats the split
    assert slow_threads.best_threads == 1
    assert slow_threads.as_dict()["gain"] == pytest.approx(-0.2)
    fast_threads = SplitGain(1.0, 2.0, 2.0, 2.5, 1 / 3, 2, True, in_turn_one_s=4.0)
    assert fast_threads.threads_gain == fast_threads.gain == pytest.approx(-0.2)
    assert fast_threads.best_threads == 2


def test_one_core_measures_unpinned_lanes_and_restores_the_caller() -> None:
    net, x = _net()
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    got = measure_split_gain(net, x, repeats=2, cores={min(cores)})
    assert (got.cores, got.pinned) == (1, False)
    assert min(got.forward_s, got.backward_s, got.in_turn_s, got.split_s) > 0
    assert got.beta == pytest.approx(got.forward_s / (got.forward_s + got.backward_s))
    assert torch.get_num_threads() == threads
    assert os.sched_getaffinity(0) == cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_two_cores_measure_pinned_lanes_at_the_given_beta() -> None:
    net, x = _net()
    cores = sorted(os.sched_getaffinity(0))[:2]
    got = measure_split_gain(net, x, beta=0.4, repeats=2, cores=cores)
    assert (got.cores, got.pinned, got.beta) == (2, True, 0.4)
    assert got.in_turn_one_s > 0


def test_bad_repetitions_are_refused() -> None:
    net, x = _net()
    with pytest.raises(ConfigError, match="repeats"):
        measure_split_gain(net, x, repeats=0)


def test_the_profile_carries_the_gain_for_the_planner() -> None:
    prof = layered_profile([1.0], [0], [1], [1])
    assert prof.split_gain is None
    assert with_split_gain(prof, 0.07).split_gain == 0.07
