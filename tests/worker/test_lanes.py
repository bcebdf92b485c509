"""SplitLanes: a forward and a backward really run at once, with their own thread counts."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from services.lib.lanes import SplitLanes, bound_to, lane_cores, split_threads


@pytest.mark.parametrize(
    ("beta", "threads", "want"),
    [(0.5, 4, (2, 2)), (0.3, 4, (1, 3)), (0.9, 4, (3, 1)), (0.5, 1, (1, 1)), (0.01, 8, (1, 7))],
)
def test_threads_are_split_by_beta_with_at_least_one_each(beta, threads, want):
    assert split_threads(beta, threads) == want


@pytest.fixture
def lanes():
    lanes = SplitLanes(0.25, threads=4, cores={0})  # one core: nothing to pin
    yield lanes
    lanes.close()


def test_the_two_lanes_run_at_the_same_time_on_their_own_thread_counts(lanes):
    met = threading.Barrier(2, timeout=10)  # only passes if both run at once
    seen: dict[str, tuple[int, int]] = {}

    def lane(name: str) -> None:
        met.wait()
        seen[name] = (threading.get_ident(), torch.get_num_threads())

    before = torch.get_num_threads()
    lanes.run(lambda: lane("forward"), lambda: lane("backward"))
    assert seen["forward"] == (lanes.lane_ident, 1)
    assert seen["backward"] == (threading.get_ident(), 3)
    assert torch.get_num_threads() == before  # the caller gets its count back


def test_a_failing_backward_returns_only_after_the_forward_ended(lanes):
    ended = threading.Event()

    def forward() -> None:
        time.sleep(0.2)
        ended.set()

    def backward() -> None:
        raise RuntimeError("backward broke")

    with pytest.raises(RuntimeError, match="backward broke"):
        lanes.run(forward, backward)
    assert ended.is_set()


def test_the_forwards_error_is_raised_and_the_backwards_wins_over_it(lanes):
    def broken(what: str) -> None:
        raise ValueError(what)

    with pytest.raises(ValueError, match="forward"):
        lanes.run(lambda: broken("forward"), None)
    with pytest.raises(ValueError, match="backward"):
        lanes.run(lambda: broken("forward"), lambda: broken("backward"))
    lanes.run(lambda: None, lambda: None)  # the lane still works after errors


def test_a_pair_computes_bitwise_what_the_two_tasks_compute_in_turn():
    """Forward of one micro-batch beside the backward of another: same numbers as in turn."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64)

    def in_turn() -> tuple[torch.Tensor, list[torch.Tensor]]:
        net.zero_grad()
        net(x1).square().sum().backward()
        return net(x2).detach(), [p.grad.clone() for p in net.parameters()]

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # both lanes get one thread below
    try:
        want_out, want_grads = in_turn()
    finally:
        torch.set_num_threads(before)
    net.zero_grad()
    loss = net(x1).square().sum()
    got: dict[str, torch.Tensor] = {}
    lanes = SplitLanes(0.5, threads=2, cores={0})
    try:
        lanes.run(lambda: got.setdefault("out", net(x2).detach()), loss.backward)
    finally:
        lanes.close()
    assert torch.equal(got["out"], want_out)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), want_grads, strict=True))


@pytest.mark.parametrize(
    ("beta", "cores", "want"),
    [
        (0.5, {0}, None),
        (0.5, {0, 1}, ({0}, {1})),
        (0.3, {4, 5, 6, 7}, ({4}, {5, 6, 7})),
        (0.7, {0, 1, 2, 3}, ({0, 1, 2}, {3})),
        (0.99, {2, 3}, ({2}, {3})),
    ],
)
def test_cores_are_split_by_beta_and_disjoint(beta, cores, want):
    got = lane_cores(beta, cores)
    assert got == (None if want is None else tuple(frozenset(c) for c in want))


two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs two cores this process may run on",
)


@two_cores
def test_on_two_cores_each_lane_runs_on_its_own_core_with_one_thread_per_core():
    cores = sorted(os.sched_getaffinity(0))[:2]
    met = threading.Barrier(2, timeout=10)
    seen: dict[str, tuple[set[int], int]] = {}

    def lane(name: str) -> None:
        met.wait()  # both at once, each already on its cores
        seen[name] = (os.sched_getaffinity(0), torch.get_num_threads())

    before = os.sched_getaffinity(0)
    lanes = SplitLanes(0.5, threads=8, cores=cores)
    try:
        assert lanes.pinned
        lanes.run(lambda: lane("forward"), lambda: lane("backward"))
    finally:
        lanes.close()
    assert seen == {"forward": ({cores[0]}, 1), "backward": ({cores[1]}, 1)}
    assert os.sched_getaffinity(0) == before  # the caller gets all its cores back


@two_cores
def test_unpinned_lanes_keep_the_callers_cores():
    cores = sorted(os.sched_getaffinity(0))[:2]
    seen: dict[str, set[int]] = {}
    with bound_to(cores):
        lanes = SplitLanes(0.5, threads=2, cores=cores, pin=False)
        try:
            assert not lanes.pinned
            lanes.run(
                lambda: seen.setdefault("forward", os.sched_getaffinity(0)),
                lambda: seen.setdefault("backward", os.sched_getaffinity(0)),
            )
        finally:
            lanes.close()
    assert seen == {"forward": set(cores), "backward": set(cores)}


@two_cores
def test_a_pinned_pair_computes_bitwise_what_the_two_tasks_compute_in_turn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net.zero_grad()
        net(x1).square().sum().backward()
        want_out, want_grads = net(x2).detach(), [p.grad.clone() for p in net.parameters()]
    finally:
        torch.set_num_threads(before)
    net.zero_grad()
    loss = net(x1).square().sum()
    got: dict[str, torch.Tensor] = {}
    lanes = SplitLanes(0.5, cores=sorted(os.sched_getaffinity(0))[:2])
    try:
        lanes.run(lambda: got.setdefault("out", net(x2).detach()), loss.backward)
    finally:
        lanes.close()
    assert torch.equal(got["out"], want_out)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), want_grads, strict=True))
