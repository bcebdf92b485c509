"""A plan member's poison, or our own overflow, fails the job naming it; nothing bad is committed.

Real coordinator and worker processes over ZeroMQ, real Redis. One worker of
the plan is `tests.security.poison_worker`: it holds its place in the plan (its
parts pass every transport check) but spoils what it sends from round 2 on:
nan activations, inf gradients, nan all-reduce chunks, or labels of 10**6.
Each time the job must fail within the round with an error that names that
peer and what was wrong, every worker process must live to exit cleanly (no
IndexError from the loss), and the last committed checkpoint must be exactly
the single-process weights of the rounds before the poison (no nan in it).
A learning rate so large that the logits overflow makes the loss of the last
stage non-finite: that fails the job naming the loss, and the round is not
committed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from common.checkpoint import load_full_state
from common.exit_codes import ExitCode
from common.store import Store
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage
from tests.reference import assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

MLP = {"name": "mlp", "options": {"hidden": 16, "depth": 2}}
ROUNDS = 4
POISON_ROUND = 2
"""Rounds 0 and 1 are honest and committed; the poison starts in round 2."""
OPT = {"kind": "sgd", "lr": 0.05}
# a and b all-reduce stage 0 (a's ring successor is b); c is the last stage
PLAN = {
    "global_batch": 8,
    "microbatches": 2,
    "stages": [stage(0, 2, "a", "b"), stage(2, 3, "c")],
}


def _job(job_id: str, optimizer: dict[str, Any], rounds: int = ROUNDS) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "model": MLP,
        "seed": 1,
        "rounds": rounds,
        "optimizer": optimizer,
        "checkpoint_every": 1,
    }


def _failed(cluster: LocalCluster, store: Store, job_id: str) -> str:
    """The error job `job_id` failed with; every worker must then exit cleanly (none died)."""
    code = cluster.wait("coordinator", 120)
    assert code == ExitCode.JOB_FAILED, (code, cluster.log_tail("coordinator", 40))
    record = store.get_fields("job", job_id)
    assert record.get("state") == "failed", record
    cluster.wait_workers_exit()
    for name in cluster.workers:
        assert "IndexError" not in cluster.log(name), cluster.log_tail(name)
    return str(record["error"])


def _all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget):
    c = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    yield c
    c.close()


@pytest.fixture
def store(redis_url, cluster_name):
    s = Store(redis_url, cluster_name)
    yield s
    s.close()


# poisoner, the workers it sends the spoiled part to, the part, what is wrong with it
SAMPLES = r"micro-batch \d, samples \[\d+, \d+\),"
CASES = {
    "nan-activations": (
        "a",
        ["c"],
        f"activations of {SAMPLES}",
        r"non-finite activations: 1 nan, 0 inf of \d+ values",
    ),
    "inf-gradients": (
        "c",
        ["a", "b"],
        f"gradients of {SAMPLES}",
        r"non-finite gradients: 0 nan, 1 inf of \d+ values",
    ),
    "nan-chunks": (
        "a",
        ["b"],
        r"reduce chunk \d of step 0",
        r"non-finite values: 1 nan, 0 inf of \d+ values",
    ),
    "huge-labels": (
        "a",
        ["c"],
        f"activations of {SAMPLES}",
        r"\d labels outside \[0, 10\) \(e\.g\. 1000000\)",
    ),
}


SLOW = {"inf-gradients", "nan-chunks"}
"""Kept out of the default run for its time budget (the pool's unit tests cover their checks)."""


@pytest.mark.parametrize(
    "poison", [pytest.param(p, marks=[pytest.mark.slow] if p in SLOW else []) for p in CASES]
)
def test_a_plan_member_poisoning_its_parts_fails_the_job_naming_it(cluster, store, poison):
    poisoner, receivers, part, why = CASES[poison]
    flags = ["--poison", poison, "--from-round", str(POISON_ROUND)]
    for name in ("a", "b", "c"):
        module = "tests.security.poison_worker" if name == poisoner else "services.worker.main"
        cluster.spawn(name, ["-m", module, *(flags if name == poisoner else []), "--device", name])
        cluster.workers.append(name)
    job_id = f"poison-{poison}"
    cluster.start_coordinator(_job(job_id, OPT), PLAN)

    error = _failed(cluster, store, job_id)
    who = "|".join(receivers)
    pattern = (
        rf"worker ({who}) failed in round {POISON_ROUND}: PeerDataError: refused {part} "
        rf"in round {POISON_ROUND} from '{poisoner}': {why}"
    )
    assert re.fullmatch(pattern, error), error
    # the poisoned round was not committed, and the last checkpoint is the honest one
    assert int(store.get_fields("job", job_id)["round"]) == POISON_ROUND
    weights = load_full_state(store, job_id, POISON_ROUND)
    assert _all_finite(weights)
    ref, _ = reference_train(MLP, 1, 8, POISON_ROUND, OPT, total_rounds=ROUNDS)
    assert_matches_reference(weights, ref)


HUGE_LR = {"kind": "sgd", "lr": 1e15, "momentum": 0.0}
"""One step at this rate leaves finite weights whose next logits overflow (checked below)."""


def test_a_non_finite_loss_of_our_own_fails_the_job_and_does_not_commit_the_round(cluster, store):
    # the plain way: round 0's loss and weights are finite, round 1's loss is not
    _, losses = reference_train(MLP, 1, 8, 2, HUGE_LR)
    ref, _ = reference_train(MLP, 1, 8, 1, HUGE_LR, total_rounds=2)
    assert torch.isfinite(torch.tensor(losses[0])) and not torch.isfinite(torch.tensor(losses[1]))
    assert _all_finite(ref)

    pipeline = {**PLAN, "stages": [stage(0, 2, "a"), stage(2, 3, "c")]}
    cluster.start_workers(["a", "c"])
    cluster.start_coordinator(_job("overflow", HUGE_LR, rounds=2), pipeline)

    error = _failed(cluster, store, "overflow")
    assert re.fullmatch(
        r"worker c failed in round 1: NonFiniteError: the loss of micro-batch 0 in round 1 "
        r"is not finite: [01] nan, [01] inf of 1 values",
        error,
    ), error
    assert int(store.get_fields("job", "overflow")["round"]) == 1
    weights = load_full_state(store, "overflow", 1)
    # weights near 1e15 after that one step: round-off is relative to their size
    scale = max(float(t.abs().max()) for t in ref.values())
    assert_matches_reference(weights, ref, tol=1e-6 * scale)
