"""`mode: async` without a drain between windows, on a whole plan's runners in one process.

While a stage finishes window r it already forwards the first micro-batches of
window r+1 (the first stage's 1F1B over a continuous stream); its round ends
after its own last backward of window r, and the forwards run ahead are carried
into round r+1. The lockstep driver runs every task the moment it is ready, so
the order is deterministic: it shows the run-ahead, and the weights equal the
single-process replay of the stream (`reference_train_async`).
"""

from __future__ import annotations

import pytest
import torch

from common.errors import NonFiniteError
from common.job import JobSpec
from common.memory_model import stashed_copies
from common.plan import Plan
from services.worker.stash import WeightStash
from tests.reference import assert_losses_match, assert_matches_reference, reference_train_async
from tests.worker import test_pool_memory as pm
from tests.worker.local_pipeline import LocalPipeline

MODEL = {"name": "small_cnn"}
SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9}
BATCH = 32
DEPTH3 = [
    {"start": 0, "end": 2, "devices": [{"device": "a"}]},
    {"start": 2, "end": 5, "devices": [{"device": "b"}]},
    {"start": 5, "end": 7, "devices": [{"device": "c"}]},
]

BATCH_NORM = {"name": "mobilenet_v2", "options": {"width_mult": 0.25}}  # 20 layers
BATCH_NORM_STAGES = [
    {"start": 0, "end": 7, "devices": [{"device": "a"}]},
    {"start": 7, "end": 14, "devices": [{"device": "b"}]},
    {"start": 14, "end": 20, "devices": [{"device": "c"}]},
]


def async_pipeline(store, m, rounds, every=0, model=MODEL, stages=DEPTH3):
    job = JobSpec.model_validate(
        {
            "job_id": "stream",
            "model": model,
            "seed": 7,
            "rounds": rounds,
            "optimizer": SGD,
            "mode": "async",
            "aggregate_every": every,
        }
    )
    return LocalPipeline(store, job, Plan(global_batch=BATCH, microbatches=m, stages=stages))


@pytest.mark.parametrize(("m", "every"), [(4, 0), (8, 0), (4, 2), (8, 3)])
def test_stages_forward_the_next_window_before_their_round_ends(store, monkeypatch, m, every):
    stashed: dict[int, int] = {}
    snapshot = WeightStash.snapshot

    def counted(self, version):
        snapshot(self, version)
        stashed[id(self)] = max(stashed.get(id(self), 0), len(self.versions))

    monkeypatch.setattr(WeightStash, "snapshot", counted)
    rounds = 3
    pipe = async_pipeline(store, m, rounds, every)
    losses = []
    for r in range(rounds):
        results, order = pipe.run_lockstep(r)
        losses.append(results["c"].loss_sum)
        for name, runner in pipe.runners.items():
            mine = [a for n, a in order if n == name]
            ahead = [a.mb for a in mine if a.kind == "F" and a.mb >= m]
            # K_s - 1 forwards of window r+1 run before round r ends, except on
            # the last stage (K = 1) and in the job's last window
            want = runner.k - 1 if r + 1 < rounds else 0
            assert ahead == list(range(m, m + want)), (r, name, [str(a) for a in mine])
            assert results[name].max_alive <= runner.k
    k0 = pipe.plan.warmup(0)
    ref, ref_losses = reference_train_async(
        MODEL, 7, BATCH, m, k0, rounds, SGD, aggregate_every=every
    )
    assert_matches_reference(pipe.weights(), ref)
    assert_losses_match(losses, ref_losses)
    # the planner's count of stashed versions bounds what each stage really held
    bound = stashed_copies(k0, bool(every))
    assert 0 < max(stashed.values()) <= bound, (stashed, bound)
    # and the slots the snapshots are copied into, which are never given back
    slots = {name: runner.stash.slots for name, runner in pipe.runners.items()}
    assert 0 < max(slots.values()) <= bound, (slots, bound)
    assert pipe.out.dropped == []


@pytest.mark.parametrize(
    ("model", "stages"), [(MODEL, DEPTH3), (BATCH_NORM, BATCH_NORM_STAGES)], ids=["cnn", "bn"]
)
def test_the_live_state_at_each_round_end_is_a_consistent_cut(store, model, stages):
    """Forwards run ahead change no weight and no batch-norm statistic before their window.

    The stream's first R windows are a job of R rounds (a constant learning
    rate), so at each round end the live state (weights and batch-norm
    statistics) must equal that shorter replay.
    """
    rounds = 3
    pipe = async_pipeline(store, 4, rounds, every=2, model=model, stages=stages)
    k0 = pipe.plan.warmup(0)
    for r in range(rounds):
        pipe.run_lockstep(r)
        assert pipe.runners["a"].stream is not None
        assert (pipe.runners["a"].stream.ahead is None) == (r + 1 == rounds)
        ref, _ = reference_train_async(model, 7, BATCH, 4, k0, r + 1, SGD, aggregate_every=2)
        assert_matches_reference(pipe.weights(), ref, what=f"the live state after round {r}")


def test_what_runs_ahead_stays_within_the_planners_in_flight_count(store):
    """Saved activations peak at K_s micro-batches per stage, windows carried over included.

    The planner sizes a stage for K_s micro-batches in flight (`stage_bytes`);
    the forwards run ahead count against the same bound, and the pool holds no
    more than the synchronous bound of `test_pool_memory` allows.
    """
    job = JobSpec.model_validate(
        {
            "job_id": "memory",
            "model": pm.MLP,
            "seed": 7,
            "rounds": 4,
            "optimizer": {"kind": "sgd", "lr": 0.05},
            "mode": "async",
        }
    )
    stages = [{"start": p, "end": p + 1, "devices": [{"device": f"d{p}"}]} for p in range(pm.S)]
    plan = Plan(global_batch=pm.M * pm.N, microbatches=pm.M, stages=stages)
    pipe = LocalPipeline(store, job, plan)
    saved_peaks = []
    for round_no in range(4):
        results, order = pipe.run_lockstep(round_no)
        got = [results[f"d{p}"] for p in range(pm.S)]
        saved_peaks.append([r.peak_saved_bytes for r in got])
        for p in range(pm.S):
            assert got[p].max_alive <= pm.K[p]
            ahead = min(pm.K[p - 1] + 1, pm.M) - pm.K[p] if p > 0 else 0
            bound = pm.K[p] * (pm.kept(p) + pm.gradient(p)) + ahead * pm.received(p)
            assert got[p].peak_bytes <= bound, (round_no, p, got[p].peak_bytes, bound)
        carried = [a for _, a in order if a.kind == "F" and a.mb >= pm.M]
        assert bool(carried) == (round_no < 3)
    # every round holds exactly K_s micro-batches at its peak, no more
    assert saved_peaks == [[pm.K[p] * pm.kept(p) for p in range(pm.S)]] * 4
    for pool in pipe.pools.values():  # the last window runs nothing ahead: all let go
        assert (pool.resident_bytes(), pool.saved_bytes) == (0, 0)
    assert pipe.out.dropped == []


def test_the_threaded_round_loop_runs_ahead_and_carries_it_over(store):
    """`run_round` (one thread per device, real waits) leaves forwards of the next window."""
    rounds = 3
    pipe = async_pipeline(store, 4, rounds)
    for r in range(rounds):
        pipe.run("run_round", r)
        streams = {n: runner.stream for n, runner in pipe.runners.items()}
        # the first stage always has its next window's inputs: K_0 - 1 of them ran ahead
        ahead = {n: sorted(s.ahead.ctx) if s and s.ahead else [] for n, s in streams.items()}
        assert ahead["a"] == ([0, 1, 2] if r + 1 < rounds else []), ahead
        assert ahead["c"] == [], ahead
    ref, _ = reference_train_async(MODEL, 7, BATCH, 4, pipe.plan.warmup(0), rounds, SGD)
    assert_matches_reference(pipe.weights(), ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_fails_its_window_naming_the_stage(store, monkeypatch, bad):
    # updates are not checked one by one: the weights are, once per window, before
    # RoundDone; a bad gradient at micro-batch 1 must still fail that very round
    m = 4
    pipe = async_pipeline(store, m, rounds=3)
    last = pipe.runners["c"]
    take = WeightStash.take_grads
    taken: list[int] = []

    def poisoned(self, version):
        grads = take(self, version)
        if self is last.stash:
            taken.append(version)
            if len(taken) == m + 2:  # micro-batch 1 of round 1
                grads = [g if g is None else torch.full_like(g, bad) for g in grads]
        return grads

    monkeypatch.setattr(WeightStash, "take_grads", poisoned)
    pipe.run_lockstep(0)
    # the last stage runs nothing ahead and, with K_0 = 3, no forward of round 1 runs on
    # the updated version: only the window's check sees it
    want = r"the weights of stage 2 after the updates of round 1 \(.*\) is not finite"
    with pytest.raises(NonFiniteError, match=want):
        pipe.run_lockstep(1)
    assert len(taken) == 2 * m
