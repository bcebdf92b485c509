"""Fault injection: `fail_at` parses strictly and kills a real worker at exactly its point.

A fault test or a recovery benchmark is only as good as the place its failure
lands, so the integration tests check from outside, on real processes, that
the worker died by SIGKILL, that its last word was the fault, and that the
coordinator saw exactly the progress that point allows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
from pydantic import ValidationError

from common.settings import WorkerSettings
from services.worker.faults import FailAt
from tests.cluster import LocalCluster

SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


# --- parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "points"),
    [
        ("", set()),
        ("1:forward", {(1, "forward", None)}),
        ("0:backward:3", {(0, "backward", 3)}),
        (
            "2:allreduce,2:step, 3:done",
            {(2, "allreduce", None), (2, "step", None), (3, "done", None)},
        ),
        (" 10:forward:0 ", {(10, "forward", 0)}),
    ],
)
def test_good_specs_parse(text: str, points: set[tuple[int, str, int | None]]) -> None:
    fail_at = FailAt.parse(text)
    assert (fail_at.points if fail_at else set()) == points
    assert WorkerSettings(fail_at=text).fail_at == text.strip()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1", "is not ROUND:PHASE[:MB]"),
        ("1:fwd", "phase 'fwd' is not one of forward, backward, allreduce, step, done"),
        ("x:forward", "is not ROUND:PHASE[:MB]"),
        ("-1:forward", "is not ROUND:PHASE[:MB]"),
        ("1:forward:", "is not ROUND:PHASE[:MB]"),
        ("1:forward:a", "is not ROUND:PHASE[:MB]"),
        ("1:forward:0:1", "is not ROUND:PHASE[:MB]"),
        ("1:step:0", "only forward and backward take a micro-batch"),
        ("1:done:2", "only forward and backward take a micro-batch"),
        ("1:forward,", "item '' is not ROUND:PHASE[:MB]"),
        ("1:Forward", "phase 'Forward'"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(text: str, why: str) -> None:
    with pytest.raises(ValueError, match="fail_at item") as parsed:
        FailAt.parse(text)
    assert why in str(parsed.value)
    with pytest.raises(ValidationError) as settings:
        WorkerSettings(fail_at=text)
    assert settings.value.errors()[0]["loc"] == ("fail_at",)
    assert why in str(settings.value)


def test_the_environment_and_the_flag_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASTEROID_FAIL_AT", "2:step")
    assert WorkerSettings().fail_at == "2:step"
    monkeypatch.setenv("ASTEROID_FAIL_AT", "2:stop")
    with pytest.raises(ValidationError, match="fail_at"):
        WorkerSettings()


def test_a_point_without_a_microbatch_matches_the_first_one_run() -> None:
    fail_at = FailAt.parse("1:forward,1:backward:2,1:step")
    assert fail_at is not None
    assert fail_at.matches(1, "forward", 3)
    assert fail_at.matches(1, "backward", 2)
    assert not fail_at.matches(1, "backward", 0)
    assert fail_at.matches(1, "step")
    assert not fail_at.matches(0, "forward", 0)
    assert not fail_at.matches(1, "allreduce")


def test_check_kills_the_process_with_sigkill_after_one_log_line() -> None:
    code = (
        "from common.logging import configure_logging\n"
        "from services.worker.faults import FailAt\n"
        "configure_logging('info', 'json')\n"
        "f = FailAt.parse('3:backward:1')\n"
        "f.check(3, 'backward', 0)\n"
        "f.check(2, 'backward', 1)\n"
        "f.check(3, 'backward', 1)\n"
        "print('survived', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == -9, proc.stderr
    assert "survived" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    event = json.loads(lines[0])
    assert (event["event"], event["round"], event["phase"], event["mb"]) == (
        "fault injected",
        3,
        "backward",
        1,
    )


# --- real workers -----------------------------------------------------------------


def _plan() -> dict[str, Any]:
    """small_cnn on three devices: a two-device stage (so an all-reduce runs), then one."""
    return {
        "global_batch": 16,
        "microbatches": 2,
        "stages": [
            {
                "start": 0,
                "end": 3,
                "devices": [{"device": "a", "share": 1}, {"device": "b", "share": 1}],
            },
            {"start": 3, "end": 7, "devices": [{"device": "c", "share": 1}]},
        ],
    }


_AFTER_FAILURE = ("recovering", "failed", "cancelled", "finished")
"""Job states that show the coordinator has noticed the failure."""


def _committed(cluster: LocalCluster) -> list[int]:
    """Rounds the coordinator logged as committed before the failure changed the job's state.

    What a recovery replays afterwards is not what the dead worker let through.
    """
    rounds = []
    for event in cluster.log_events("coordinator"):
        if event.get("event") == "job state" and event.get("state") in _AFTER_FAILURE:
            break
        if event.get("event") == "round committed":
            rounds.append(event["round"])
    return rounds


@pytest.mark.integration
@pytest.mark.parametrize("phase", WorkerSettings.FAIL_PHASES)
def test_worker_dies_at_its_point(tmp_path, redis_url, cluster_name, budget, phase: str) -> None:
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        args = ["-m", "services.worker.main", "--device", "a", "--fail-at", f"1:{phase}"]
        victim = cluster.spawn("a", args)
        cluster.start_workers(["b", "c"])
        job = {
            "job_id": "fault",
            "model": {"name": "small_cnn"},
            "seed": 7,
            "rounds": 3,
            "optimizer": SGD,
        }
        cluster.start_coordinator(job, _plan())
        try:
            victim.wait(timeout=budget.left(90))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a did not die at 1:{phase}:\n{cluster.log_tail('a')}") from None
        assert victim.returncode == -9, cluster.log_tail("a")
        last = json.loads(cluster.log("a").splitlines()[-1])  # its last word, nothing after
        assert last["event"] == "fault injected", cluster.log_tail("a")
        mb = 0 if phase in ("forward", "backward") else None
        assert (last["round"], last["phase"], last["mb"]) == (1, phase, mb)
        if phase == "done":  # its RoundDone got out before it died: round 1 commits
            deadline = time.monotonic() + budget.left(10)
            while 1 not in _committed(cluster) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _committed(cluster) == [0, 1], cluster.log_tail("coordinator")
        else:  # round 1 cannot commit without its RoundDone, and round 0 did
            assert _committed(cluster) == [0], cluster.log_tail("coordinator")
    finally:
        cluster.close()
