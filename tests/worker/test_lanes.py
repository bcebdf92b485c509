"""SplitLanes: a forward and a backward really run at once, with their own thread counts."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from services.worker.lanes import SplitLanes, split_threads


@pytest.mark.parametrize(
    ("beta", "threads", "want"),
    [(0.5, 4, (2, 2)), (0.3, 4, (1, 3)), (0.9, 4, (3, 1)), (0.5, 1, (1, 1)), (0.01, 8, (1, 7))],
)
def test_threads_are_split_by_beta_with_at_least_one_each(beta, threads, want):
    assert split_threads(beta, threads) == want


@pytest.fixture
def lanes():
    lanes = SplitLanes(0.25, threads=4)
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
    lanes = SplitLanes(0.5, threads=2)
    try:
        lanes.run(lambda: got.setdefault("out", net(x2).detach()), loss.backward)
    finally:
        lanes.close()
    assert torch.equal(got["out"], want_out)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), want_grads, strict=True))
