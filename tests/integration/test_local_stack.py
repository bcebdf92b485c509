"""The demo's flow, shorter, on the tests' Redis: every service a real process.

Submit -> profiling (profiler service) -> planning (planner service) ->
running (workers) -> finished, with held-out evaluation, a report, exported
weights that give the accuracy the job reported, cancel, and a job the
coordinator refuses. And `asteroid up` as a person runs it: found by `status`
and `train` with nothing set, its state folder refused to a second `up`,
another folder independent.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file
from typer.testing import CliRunner

from common.checkpoint import latest_round
from common.exit_codes import ExitCode
from common.job import JobSpec
from common.job_data import open_data
from common.messages import CancelJob, SubmitJob
from common.store import Store
from common.zoo import build_model
from services.cli import app
from services.cli.client import ask_coordinator
from services.cli.follow import follow
from services.cli.report import job_report, stage_table, summary_table
from services.launcher import LocalStack
from tests.cluster import Budget
from tests.common.test_cifar10 import make_records, write
from tests.security.attacker import Attacker

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

JOB = {
    "job_id": "flow",
    "model": {"name": "small_cnn"},
    "dataset": {"kind": "synthetic", "eval_size": 128},
    "global_batch": 32,
    "micro_batch": 8,
    "rounds": 12,
    "optimizer": {"kind": "adam", "lr": 0.002, "schedule": {"kind": "cosine"}},
    "eval_every": 6,
    "checkpoint_every": 6,
    "min_workers": 3,
    "seed": 3,
}


def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting {timeout_s:.0f} s for {what}"
        time.sleep(0.2)


def _log_events(stack: LocalStack, name: str) -> list[dict]:
    """The JSON lines of one service's log."""
    out = []
    for line in (stack.log_dir / f"{name}.log").read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@pytest.fixture
def stack(tmp_path, redis_url, cluster_name):
    with LocalStack(3, tmp_path / "logs", redis_url, cluster_name, heartbeat_s=0.3) as s:
        yield s


def test_submit_profile_plan_train_evaluate_export(
    stack, redis_url, cluster_name, tmp_path, budget: Budget
):
    job = JobSpec.model_validate(JOB)
    reply = ask_coordinator(stack.coordinator, SubmitJob(job=job), timeout_s=budget.left(60))
    assert reply.ok, reply.error
    store = Store(redis_url, cluster_name)
    console = Console(file=io.StringIO(), width=120)
    view = follow(store, job.job_id, console, timeout_s=budget.left(180))
    assert view.state == "finished", (
        view.state,
        view.error,
        str(budget),
        stack.tail("coordinator"),
    )

    states = [e["event"] for e in store.read("events", job.job_id)]
    for state in ("submitted", "profiling", "planning", "running", "finished"):
        assert state in states
    assert [e["round"] for e in view.evals] == [-1, 5, 11]  # before, after 6, after 12
    first, last = view.evals[0]["eval_accuracy"], view.evals[-1]["eval_accuracy"]
    assert last > first + 0.2, view.evals
    assert len(view.rounds) == 12

    # the profile the profiler service stored is reused by a second job
    keys = [k.decode() for k in store.keys("profile", "")]
    assert len(keys) == 1
    rep = job_report(store, job.job_id)
    assert rep.sim is not None and rep.measured_samples_per_s > 0
    text = io.StringIO()
    Console(file=text, width=120).print(stage_table(rep), summary_table(rep))
    assert "measured / simulated" in text.getvalue()

    # exported weights load into the zoo model and give the reported accuracy
    out = tmp_path / "w.safetensors"
    res = CliRunner().invoke(
        app,
        ["export", "flow", "--out", str(out), "--redis-url", redis_url, "--cluster", cluster_name],
    )
    assert res.exit_code == 0, res.output
    zoo = build_model(job.model, job.seed)
    net = zoo.full()
    net.load_state_dict(load_file(out))
    net.eval()
    batches = -(-128 // 32)
    x, y = open_data(job, zoo).eval_batch(0, batches * 32)
    with torch.no_grad():
        correct = int((net(x).argmax(dim=1) == y).sum())
    assert abs(correct - last * batches * 32) <= 1, (correct, last)

    res = CliRunner().invoke(app, ["status", "--redis-url", redis_url, "--cluster", cluster_name])
    assert res.exit_code == 0, res.output
    assert "dev-0" in res.output and "flow" in res.output and "finished" in res.output

    again = JobSpec.model_validate({**JOB, "job_id": "flow-2", "rounds": 2, "eval_every": 0})
    assert ask_coordinator(stack.coordinator, SubmitJob(job=again), timeout_s=budget.left(15)).ok
    view = follow(store, "flow-2", console, timeout_s=budget.left(120))
    assert view.state == "finished", (view.state, view.error, str(budget))
    assert "profiling" in [e["event"] for e in view.events]
    assert [k.decode() for k in store.keys("profile", "")] == keys  # reused, not measured again
    store.close()


def test_cancel_stops_at_a_round_boundary_and_the_coordinator_goes_on(
    stack, redis_url, cluster_name, tmp_path, budget: Budget
):
    store = Store(redis_url, cluster_name)
    spec = {**JOB, "job_id": "long", "rounds": 500, "eval_every": 0, "checkpoint_every": 1}
    long = JobSpec.model_validate(spec)
    assert ask_coordinator(stack.coordinator, SubmitJob(job=long), timeout_s=budget.left(60)).ok
    dup = ask_coordinator(stack.coordinator, SubmitJob(job=long), timeout_s=budget.left(15))
    assert not dup.ok and "job_id: job long is already" in dup.error

    def job() -> dict:
        return store.get_fields("job", "long")

    _until(lambda: job().get("round", 0) >= 2, budget.left(150), "round 2")
    assert ask_coordinator(stack.coordinator, CancelJob(job_id="long"), budget.left(15)).ok
    _until(lambda: job().get("state") == "cancelled", budget.left(30), "the cancel")

    # the step in flight when the coordinator took the cancel (bound to its log line)
    # completes, and no later round starts: a round in flight still commits; during
    # the checkpoint of round r (its commit count), r rounds stay committed
    taken = [
        e
        for e in _log_events(stack, "coordinator")
        if e.get("event") == "job cancel requested" and e.get("job") == "long"
    ]
    assert len(taken) == 1, taken
    committed = job()["round"]
    in_flight = taken[0]["phase"] == "round"
    assert taken[0]["phase"] in ("round", "checkpoint"), taken[0]
    assert committed == taken[0]["round"] + in_flight, (taken[0], committed)
    assert [m["round"] for m in store.read("metrics", "long") if "loss" in m] == list(
        range(committed)
    )
    assert latest_round(store, "long") == committed  # the checkpoint of the last commit

    again = ask_coordinator(stack.coordinator, CancelJob(job_id="long"), budget.left(15))
    assert not again.ok and "not queued or running (cancelled)" in again.error

    # a spec the CLI would refuse, sent straight to the coordinator: refused, nothing runs
    bad = JobSpec.model_validate({**JOB, "job_id": "bad"})
    sender = Attacker(stack.coordinator)
    try:
        reply = sender.ask(SubmitJob(job=bad), budget.left(15), job__model__name="no_such_net")
    finally:
        sender.close()
    assert not reply.ok and "unknown model name 'no_such_net'" in reply.error, reply.error
    assert store.get_fields("job", "bad") == {}

    # the coordinator goes on: one epoch of a (tiny) CIFAR-10 folder in its binary format
    folder = tmp_path / "cifar"
    folder.mkdir()
    for name, n in (("data_batch_1.bin", 48), ("data_batch_2.bin", 48), ("test_batch.bin", 40)):
        write(folder / name, make_records([i % 10 for i in range(n)]))
    spec = {**JOB, "job_id": "after", "rounds": None, "epochs": 1, "eval_every": 0}
    after = JobSpec.model_validate({**spec, "dataset": {"kind": "cifar10", "path": str(folder)}})
    assert ask_coordinator(stack.coordinator, SubmitJob(job=after), budget.left(15)).ok
    view = follow(store, "after", Console(file=io.StringIO()), timeout_s=budget.left(120))
    assert view.state == "finished", (view.state, view.error, str(budget))
    assert len(view.rounds) == 3  # 96 training records, 32 per round
    assert view.evals[-1]["eval_samples"] == 40  # every held-out record once
    stack.check()
    store.close()


def _person(xdg: Path) -> dict[str, str]:
    """A person's environment: no ASTEROID_* variable, the state folder under `xdg`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    return {**env, "XDG_STATE_HOME": str(xdg), "COLUMNS": "200"}


def _asteroid(args: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run `asteroid ARGS` to its end: exit code and output (stdout and stderr)."""
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout_s,
        check=False,
    )
    return res.returncode, res.stdout.decode(errors="replace")


class _Up:
    """`asteroid up ARGS` in the background, its output in a file; stopped with SIGINT."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout_s: float) -> str:
        """The "submit with" line, once `up` printed it."""
        deadline = time.monotonic() + timeout_s
        while (line := re.search(r"^submit with: .*$", self.text(), re.M)) is None:
            assert self.proc.poll() is None, f"up exited ({self.proc.returncode}):\n{self.text()}"
            assert time.monotonic() < deadline, f"up not up in {timeout_s:.0f} s:\n{self.text()}"
            time.sleep(0.3)
        return line[0]

    def stop(self, timeout_s: float) -> int:
        """SIGINT, then its exit code (SIGKILL if it outstays `timeout_s`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@pytest.mark.timeout(600)  # three `up`s and six CLI runs, each importing torch
def test_up_is_found_by_status_and_train_and_owns_its_state_folder(tmp_path, budget: Budget):
    env = _person(tmp_path / "xdg")
    state = tmp_path / "xdg" / "asteroid"
    first = _Up(["--workers", "2", "--logs", str(tmp_path / "logs")], env, tmp_path / "up.log")
    other: _Up | None = None
    try:
        line = first.wait_up(budget.left(120))
        assert line == "submit with: asteroid train JOB.yaml (from another terminal; status too)"
        found = json.loads((state / "cluster.json").read_text())
        assert found["pid"] == first.proc.pid and found["cluster"] == "local"
        assert f"cluster up: coordinator {found['coordinator']}," in first.text()

        # status with nothing set finds the cluster: its workers, once they heartbeat
        deadline = time.monotonic() + budget.left(90)
        while True:
            code, out = _asteroid(["status"], env, budget.left(60))
            assert code == 0, out
            if "dev-0" in out and "dev-1" in out:
                break
            assert time.monotonic() < deadline, out
            time.sleep(1)

        # a second up on the same folder refuses, naming the first; the first goes on
        code, out = _asteroid(["up", "--workers", "1"], env, budget.left(60))
        assert code == ExitCode.CONFIG, out
        said = " ".join(out.split())
        assert f"pid {first.proc.pid}" in said and found["coordinator"] in said, said
        assert first.proc.poll() is None

        # another state folder runs independently, told how to be found
        other_dir = tmp_path / "other"
        args = ["--workers", "1", "--logs", str(tmp_path / "logs2"), "--state-dir", str(other_dir)]
        other = _Up(args, env, tmp_path / "up2.log")
        line = other.wait_up(budget.left(120))
        theirs = json.loads((other_dir / "cluster.json").read_text())
        assert f"ASTEROID_COORDINATOR={theirs['coordinator']}" in line
        assert theirs["coordinator"] != found["coordinator"]
        assert other.stop(budget.left(30)) == ExitCode.INTERRUPTED, other.text()
        assert not (other_dir / "cluster.json").exists()

        # train with nothing set submits to the cluster and follows it to the end
        job = tmp_path / "job.yaml"
        spec = {**JOB, "job_id": "found", "rounds": 2, "eval_every": 0, "min_workers": 2}
        job.write_text(yaml.safe_dump({k: v for k, v in spec.items() if k != "checkpoint_every"}))
        code, out = _asteroid(["train", str(job)], env, budget.left(180))
        assert code == 0, out + first.text()
        assert f"submitted to {found['coordinator']}" in " ".join(out.split()), out
        assert "job found finished" in out, out
    finally:
        if other is not None:
            other.stop(30)
        stopped = first.stop(30)
    assert stopped == ExitCode.INTERRUPTED, first.text()
    assert not (state / "cluster.json").exists()
    # gone: status no longer finds it
    code, out = _asteroid(["status"], env, budget.left(60))
    assert "dev-0" not in out and found["redis_url"] not in out, out
