"""The cluster of deploy/compose.yaml trains, exports and survives a killed worker container.

Everything is real: the images `make images` built, docker-compose, CURVE on
every socket, Redis with one ACL user per role, and the host's `asteroid` CLI
talking to the published coordinator and reading Redis as the read-only
operator. A job trained in the containers must give the weights of plain
single-process training, and those weights, evaluated here, the accuracy the
job reported; a job whose worker container is killed mid-run must recover on
the survivors and still end with those weights, every round committed once.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from common.checkpoint import load_full_state
from common.ledger import effective_rounds
from common.plan import Plan
from common.store import Store
from tests.cluster import Budget
from tests.compose.stack import ComposeStack, asteroid_command, run
from tests.reference import assert_matches_reference, reference_eval, reference_train

pytestmark = pytest.mark.integration

MODEL = {"name": "small_cnn"}
DATASET = {"kind": "synthetic", "eval_size": 256}
SGD = {"kind": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
"""As in tests/integration/test_recovery.py: ten rounds of float re-association by a
changed partition stay far below the reference tolerance with a step this small."""
BATCH = 32
SEED = 5


def job_spec(job_id: str, rounds: int, batch: int = BATCH, **extra: Any) -> dict[str, Any]:
    """A small_cnn job planned by the planner for all three workers."""
    return {
        "job_id": job_id,
        "model": MODEL,
        "dataset": DATASET,
        "seed": SEED,
        "global_batch": batch,
        "micro_batch": batch // 4,
        "rounds": rounds,
        "optimizer": SGD,
        "min_workers": 3,
        **extra,
    }


def asteroid(stack: ComposeStack, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The host's `asteroid` CLI as the operator of the compose cluster."""
    try:
        return subprocess.run(
            [asteroid_command(), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=stack.operator_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"asteroid {' '.join(args)} took over {timeout_s:.0f} s\n{stack.logs('coordinator')}"
        ) from exc


def write_job(tmp: Path, spec: dict[str, Any]) -> Path:
    path = tmp / f"{spec['job_id']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def wait_for(what: str, pred: Any, timeout_s: float, stack: ComposeStack) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:.0f} s\n{stack.logs('coordinator')}")
        time.sleep(0.5)


# Bringing the stack up (module fixture, counted in the first test) takes minutes on a
# loaded two-core machine: nine containers import torch under their CPU limits.
@pytest.mark.timeout(900)
def test_a_job_trained_in_containers_exports_the_weights_and_accuracy_it_reported(
    stack: ComposeStack, tmp_path: Path, budget: Budget
) -> None:
    spec = job_spec("compose-train", rounds=6)
    done = asteroid(stack, "train", str(write_job(tmp_path, spec)), timeout_s=budget.left(500))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{stack.logs('coordinator')}"
    assert "job compose-train finished" in done.stdout, done.stdout

    out = tmp_path / "weights.safetensors"
    exported = asteroid(
        stack, "export", "compose-train", "--out", str(out), timeout_s=budget.left(60)
    )
    assert exported.returncode == 0, exported.stdout + exported.stderr
    weights = load_file(out)

    store = Store(stack.redis_url("operator"), stack.cluster)
    try:
        plan = Plan.model_validate(store.get_json("plan", "compose-train"))
        (final,) = [m for m in store.read("metrics", "compose-train") if "eval_accuracy" in m]
    finally:
        store.close()
    assert len(set(plan.devices)) >= 2, plan  # trained across containers, not on one

    ref, _ = reference_train(MODEL, SEED, BATCH, spec["rounds"], SGD, dataset=DATASET)
    assert_matches_reference(weights, ref)
    _, correct, samples = reference_eval(MODEL, SEED, weights, 256, dataset=DATASET)
    assert final["eval_samples"] == samples
    assert final["eval_accuracy"] == pytest.approx(correct / samples, abs=1e-9)


@pytest.mark.timeout(900)
def test_a_job_recovers_when_a_worker_container_is_killed(
    stack: ComposeStack, tmp_path: Path, budget: Budget
) -> None:
    # Few rounds (float re-association stays small) of a large batch: several seconds
    # each, so the job is still running when the container is killed.
    rounds, batch = 10, 256
    jid = "compose-kill"
    spec = job_spec(jid, rounds=rounds, batch=batch, checkpoint_every=2)
    sent = asteroid(
        stack, "train", "--no-follow", str(write_job(tmp_path, spec)), timeout_s=budget.left(60)
    )
    assert sent.returncode == 0, sent.stdout + sent.stderr

    store = Store(stack.redis_url("operator"), stack.cluster)
    try:
        wait_for(
            "round 2",
            lambda: store.get_fields("job", jid).get("round", 0) >= 2,
            budget.left(400),
            stack,
        )
        plan = Plan.model_validate(store.get_json("plan", jid))
        assert len(set(plan.devices)) >= 2, plan
        victim = str(plan.devices[-1])
        run(["docker", "kill", stack.container(victim)], 30)
        at = store.get_fields("job", jid).get("round", 0)
        assert at < rounds, f"the job ended (round {at}) before {victim} was killed"

        wait_for(
            "end of the job",
            lambda: store.get_fields("job", jid).get("state") in ("finished", "failed"),
            budget.left(400),
            stack,
        )
        job = store.get_fields("job", jid)
        assert job["state"] == "finished", (job, stack.logs("coordinator"))
        recovered = [e for e in store.read("events", jid) if e["event"] == "recovered"]
        assert recovered, stack.logs("coordinator")
        assert recovered[0]["lost"] == [victim], recovered
        ledger = effective_rounds(store.read("ledger", jid))
        assert [e["round"] for e in ledger] == list(range(rounds))
        weights = load_full_state(store, jid, rounds)
    finally:
        store.close()
    ref, _ = reference_train(MODEL, SEED, batch, rounds, SGD, dataset=DATASET)
    try:
        assert_matches_reference(weights, ref)
    except AssertionError as exc:  # which recovery (round, source, new stages) it was
        raise AssertionError(f"{exc}, after {recovered}") from None
