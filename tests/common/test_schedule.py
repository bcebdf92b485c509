"""Rule checker for schedules, run without a network.

Simulates S stages executing either the canonical `schedule()` lists or the
dynamic `next_task()` policy against each other: forward before backward,
at most K_p activations alive (M under GPipe), every receive matched by a
send, and no deadlock.

Rules alone pass a scheduler that never pipelines (K=1 everywhere keeps every
bound), so the orders are also compared with the textbook ones: when every
step takes one tick on every stage at once, 1F1B is exactly K_p warm-up
forwards, then one backward and one forward alternating, then the cool-down
backwards, with exactly min(K_p, M) micro-batches alive at the peak; and
deliberately broken schedulers are shown to fail that comparison.
"""

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.schedule import (
    Action,
    PoolView,
    eval_schedule,
    next_eval,
    next_pair,
    next_task,
    parse_action,
    schedule,
)


def k_of(p, s, m):
    return max(1, min(2 * (s - p) - 1, m))


def _view(p, s, m, nf, alive, fwd_done, bwd_done) -> PoolView:
    """What stage p's pool shows: its own inputs on stage 0, else what its neighbours sent."""
    return PoolView(
        next_forward=nf[p],
        alive=len(alive[p]),
        forward_ready=frozenset(range(m)) if p == 0 else frozenset(fwd_done[p - 1]) - fwd_done[p],
        backward_ready=frozenset(alive[p]) if p == s - 1 else frozenset(bwd_done[p + 1]) & alive[p],
    )


def simulate_dynamic(s, m, policy, ks=None):
    """Run every stage's next_task until done; returns per-stage traces and peak alive."""
    ks = ks or [k_of(p, s, m) for p in range(s)]
    fwd_done = [set() for _ in range(s)]  # F done on stage p
    bwd_done = [set() for _ in range(s)]
    nf = [0] * s
    alive = [set() for _ in range(s)]
    peak = [0] * s
    trace = [[] for _ in range(s)]
    progress = True
    while progress:
        progress = False
        for p in range(s):
            view = _view(p, s, m, nf, alive, fwd_done, bwd_done)
            a = next_task(view, p, ks[p], m, policy)
            if a is None:
                continue
            progress = True
            trace[p].append(a)
            if a.kind == "F":
                fwd_done[p].add(a.mb)
                alive[p].add(a.mb)
                nf[p] += 1
                peak[p] = max(peak[p], len(alive[p]))
            else:
                alive[p].remove(a.mb)
                bwd_done[p].add(a.mb)
    assert all(len(b) == m for b in bwd_done), f"deadlock: {trace}"
    return trace, peak


@given(st.integers(1, 6), st.integers(1, 12))
def test_dynamic_1f1b_respects_k_and_finishes(s, m):
    trace, peak = simulate_dynamic(s, m, "1f1b")
    for p in range(s):
        assert peak[p] <= k_of(p, s, m)
        check_stage_rules(trace[p], m)


@given(st.integers(1, 6), st.integers(1, 12))
def test_dynamic_gpipe_holds_all_m(s, m):
    _, peak = simulate_dynamic(s, m, "gpipe")
    assert peak == [m] * s


def simulate_pairs(s, m, policy):
    """Every stage runs `next_pair`'s backward and forward in one tick; traces and peaks.

    The peak counts the backward's micro-batch as alive for the whole tick, the
    forward's activations being made before the backward frees its own.
    """
    ks = [k_of(p, s, m) for p in range(s)]
    fwd_done = [set() for _ in range(s)]
    bwd_done = [set() for _ in range(s)]
    nf, alive, peak = [0] * s, [set() for _ in range(s)], [0] * s
    trace, pairs = [[] for _ in range(s)], [0] * s
    progress = True
    while progress:
        progress = False
        views = [_view(p, s, m, nf, alive, fwd_done, bwd_done) for p in range(s)]
        for p in range(s):  # every stage decides on the same tick's view, then all run
            b, f = next_pair(views[p], p, ks[p], m, policy)
            if b is None and f is None:
                continue
            progress = True
            pairs[p] += b is not None and f is not None
            if f is not None:
                trace[p].append(f)
                alive[p].add(f.mb)
                nf[p] += 1
            peak[p] = max(peak[p], len(alive[p]))
            if b is not None:
                trace[p].append(b)
                alive[p].remove(b.mb)
                bwd_done[p].add(b.mb)
            if f is not None:
                fwd_done[p].add(f.mb)
    assert all(len(b) == m for b in bwd_done), f"deadlock: {trace}"
    return trace, peak, pairs


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
@given(s=st.integers(1, 6), m=st.integers(1, 12))
def test_pairs_finish_obey_the_rules_and_hold_at_most_one_more_than_k(policy, s, m):
    trace, peak, pairs = simulate_pairs(s, m, policy)
    for p in range(s):
        check_stage_rules(trace[p], m)
        limit = k_of(p, s, m) if policy == "1f1b" else m
        assert peak[p] <= limit + 1
    if policy == "1f1b" and m > k_of(0, s, m):
        assert pairs[0] > 0  # the first stage's inputs are always ready: it overlaps


def _at_k(forward: set[int], backward: set[int]) -> PoolView:
    """Stage 0 with K_p = 3 micro-batches alive and forward 3 next."""
    return PoolView(3, 3, frozenset(forward), frozenset(backward))


def test_a_pair_is_the_sequential_backward_and_the_forward_it_unblocks():
    view = _at_k({3}, {0})
    assert next_task(view, 0, 3, 8, "1f1b") == Action(0, "B", 0)  # in turn: the backward first
    assert next_pair(view, 0, 3, 8, "1f1b") == (Action(0, "B", 0), Action(0, "F", 3))
    assert next_pair(_at_k(set(), {0}), 0, 3, 8, "1f1b") == (Action(0, "B", 0), None)
    assert next_pair(_at_k({3}, set()), 0, 3, 8, "1f1b") == (None, None)
    assert next_pair(view, 0, 3, 8, "gpipe") == (None, Action(0, "F", 3))


def check_stage_rules(actions, m):
    seen_f = set()
    for a in actions:
        if a.kind == "F":
            seen_f.add(a.mb)
        else:
            assert a.mb in seen_f, f"backward before forward: {a}"
    assert sorted(a.mb for a in actions if a.kind == "F") == list(range(m))
    assert sorted(a.mb for a in actions if a.kind == "B") == list(range(m))


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
@pytest.mark.parametrize("s,m", [(1, 1), (3, 4), (4, 8), (2, 5)])
def test_canonical_schedules_obey_rules(policy, s, m):
    for p in range(s):
        k = k_of(p, s, m)
        acts = schedule(p, k, m, policy)
        check_stage_rules(acts, m)
        alive, peak = 0, 0
        for a in acts:
            alive += 1 if a.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == (min(k, m) if policy == "1f1b" else m)


def test_text_form():
    acts = schedule(2, 1, 2)
    assert [str(a) for a in acts] == ["2F0", "2B0", "2F1", "2B1"]
    assert parse_action("12B3") == Action(12, "B", 3)
    with pytest.raises(ValueError):
        parse_action("2X0")


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        schedule(0, 1, 1, "zigzag")


def simulate_eval(s, n, arrival_order):
    """Every stage runs next_eval against the previous stage's sends; returns traces.

    `arrival_order(p, sent)` reorders what stage p-1 has sent so far, as a network
    with several upstream devices might deliver it.
    """
    sent = [[] for _ in range(s)]  # evaluation forwards finished on stage p, in order
    trace = [[] for _ in range(s)]
    progress = True
    while progress:
        progress = False
        for p in range(s):
            ready = frozenset(range(n)) if p == 0 else frozenset(arrival_order(p, sent[p - 1]))
            view = PoolView(
                next_forward=len(trace[p]), alive=0, forward_ready=ready, backward_ready=frozenset()
            )
            a = next_eval(view, p, n)
            if a is None:
                continue
            progress = True
            assert a.kind == "F" and a.stage == p
            trace[p].append(a)
            sent[p].append(a.mb)
    return trace


@given(st.integers(1, 6), st.integers(1, 20), st.randoms(use_true_random=False))
def test_eval_runs_every_microbatch_once_in_order_whatever_the_arrival_order(s, n, rng):
    def shuffled(_p, got):
        got = list(got)
        rng.shuffle(got)
        return got

    trace = simulate_eval(s, n, shuffled)
    for p in range(s):
        assert trace[p] == eval_schedule(p, n)


def test_eval_waits_for_the_next_microbatch_and_stops_after_the_last():
    def view(nf, ready):
        return PoolView(
            next_forward=nf, alive=5, forward_ready=frozenset(ready), backward_ready=frozenset({0})
        )

    assert next_eval(view(1, {2, 3}), 1, 4) is None  # 1 has not arrived; 2 and 3 wait
    assert next_eval(view(1, {1, 2}), 1, 4) == Action(1, "F", 1)
    assert next_eval(view(4, {4}), 1, 4) is None  # all 4 ran


def test_eval_schedule_is_the_forwards_in_order():
    assert [str(a) for a in eval_schedule(3, 2)] == ["3F0", "3F1"]


# --- exact orders: the textbook 1F1B and GPipe ---------------------------------------

Decide = Callable[[PoolView, int, int, int, str], Action | None]


def textbook(stage, k, m, policy):
    """The order of the papers, as text: GPipe all F then all B; 1F1B warm-up, 1B1F, cool-down."""
    if policy == "gpipe":
        return [f"{stage}F{j}" for j in range(m)] + [f"{stage}B{j}" for j in range(m)]
    warm = min(k, m)
    steady = [
        f"{stage}{kind}{j}" for i in range(m - warm) for kind, j in (("B", i), ("F", warm + i))
    ]
    return (
        [f"{stage}F{j}" for j in range(warm)]
        + steady
        + [f"{stage}B{j}" for j in range(m - warm, m)]
    )


def simulate_ticks(s, m, policy, decide: Decide = next_task):
    """Every stage decides at once on each tick from what the previous tick finished.

    Forwards and backwards take one tick and parts arrive the tick after they
    are sent. Returns per-stage traces (text) and peak alive micro-batches.
    """
    ks = [k_of(p, s, m) for p in range(s)]
    fwd_done = [set() for _ in range(s)]
    bwd_done = [set() for _ in range(s)]
    alive = [set() for _ in range(s)]
    nf, peak = [0] * s, [0] * s
    trace = [[] for _ in range(s)]
    for _ in range(4 * s * m + 4):  # the longest schedule, with slack
        actions = [
            decide(_view(p, s, m, nf, alive, fwd_done, bwd_done), p, ks[p], m, policy)
            for p in range(s)
        ]
        for p, a in enumerate(actions):
            if a is None:
                continue
            trace[p].append(str(a))
            if a.kind == "F":
                fwd_done[p].add(a.mb)
                alive[p].add(a.mb)
                nf[p] += 1
                peak[p] = max(peak[p], len(alive[p]))
            else:
                alive[p].remove(a.mb)
                bwd_done[p].add(a.mb)
    return trace, peak


def check_pipelines(s, m, policy, decide: Decide = next_task):
    """Assert that `decide` gives the textbook order and exactly its peak on every stage."""
    trace, peak = simulate_ticks(s, m, policy, decide)
    for p in range(s):
        k = k_of(p, s, m)
        assert trace[p] == textbook(p, k, m, policy), f"stage {p} of {s}, M={m}"
        assert peak[p] == (k if policy == "1f1b" else m), f"stage {p} of {s}, M={m}: {peak}"


def test_textbook_1f1b_spelled_out():
    """S=3, M=6: K = 5, 3, 1."""
    assert [textbook(p, k_of(p, 3, 6), 6, "1f1b") for p in range(3)] == [
        ["0F0", "0F1", "0F2", "0F3", "0F4", "0B0", "0F5", "0B1", "0B2", "0B3", "0B4", "0B5"],
        ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"],
        ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3", "2F4", "2B4", "2F5", "2B5"],
    ]


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
@given(st.integers(1, 6), st.integers(1, 12))
def test_canonical_schedule_is_the_textbook_order(policy, s, m):
    for p in range(s):
        k = k_of(p, s, m)
        assert [str(a) for a in schedule(p, k, m, policy)] == textbook(p, k, m, policy)


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
@given(st.integers(1, 6), st.integers(1, 12))
def test_dynamic_policy_pipelines_exactly_as_the_textbook(policy, s, m):
    check_pipelines(s, m, policy)


def never_pipelines(view, stage, k, m, policy):
    """One micro-batch at a time: keeps every bound, overlaps nothing."""
    return next_task(view, stage, 1, m, policy)


def gpipe_instead(view, stage, k, m, policy):
    """All forwards, then all backwards, whatever the policy says."""
    return next_task(view, stage, k, m, "gpipe")


def one_short(view, stage, k, m, policy):
    """Warms up one micro-batch fewer than K_p."""
    return next_task(view, stage, max(1, k - 1), m, policy)


@pytest.mark.parametrize("broken", [never_pipelines, gpipe_instead, one_short])
def test_a_scheduler_that_does_not_pipeline_fails_the_check(broken):
    check_pipelines(3, 6, "1f1b")  # the real one passes on the same case
    with pytest.raises(AssertionError, match="stage 0 of 3"):
        check_pipelines(3, 6, "1f1b", broken)
