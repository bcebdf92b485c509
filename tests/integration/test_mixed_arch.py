"""A mixed-architecture cluster is exact: an arm64 worker beside amd64 ones trains like one process.

The arm64 worker is the real arm64 image (`make images ARCH=arm64`, its own
aarch64 torch, CPU build), run by this x86-64 host's engine under
qemu-user-static; the coordinator and three amd64 workers are processes here,
all on this machine's network (the container uses the host's). The arm64
worker holds a quarter of the last stage (the classifier head: a small share
of the work, so emulation keeps the job short): it receives activations from
and sends gradients to the amd64 stage before it over the wire, and sums its
gradients with its amd64 replica's. The final weights, read back from the
committed checkpoint, must equal single-process training of the same seed
here within 1e-6, like every equivalence test, and the two replicas of the
head, one per architecture, must hold identical weights (their digests).

Skipped without the engine, the image or qemu's binfmt handler (failed under
CI=true); `make test-arm64` builds the images first. The container is removed
whatever happens, and the test checks that none of its containers is left.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint import checkpoint_digests, load_full_state
from common.store import Store
from common.version import VERSION
from tests.cluster import Budget, LocalCluster
from tests.integration.test_equivalence import SGD, assert_replicas_agree, losses, stage
from tests.reference import (
    assert_losses_match,
    assert_matches_reference,
    reference_train,
    weight_difference,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGE = f"asteroid-edge/worker:{VERSION.replace('+', '-')}-arm64"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
LABEL = "asteroid.test=mixed-arch"
TIMEOUT_S = 900
"""pytest's limit for the test: emulation is slow (torch's import alone, 10 s here)."""
HEARTBEAT_S = 2.0
"""Every worker's heartbeat: the emulated one must never look missed while it computes."""
ROUNDS = 3
BATCH = 32
# stage 0: the convolutions, data-parallel on two amd64 workers; stage 1: the classifier head,
# data-parallel on the arm64 worker (a quarter of each micro-batch) and a third amd64 one
STAGES = [stage(0, 5, "amd-a", "amd-b"), stage(5, 7, ("arm", 1), ("amd-c", 3))]


def _docker(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def missing() -> str | None:
    """Why an arm64 container cannot run here (None: it can)."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    if _docker("info").returncode != 0:
        return "no Docker engine answers (docker info)"
    arch = _docker("image", "inspect", "--format", "{{.Architecture}}", IMAGE)
    if arch.returncode != 0:
        return f"image {IMAGE} is not built (make images ARCH=arm64)"
    if arch.stdout.strip() != "arm64":
        return f"image {IMAGE} is {arch.stdout.strip()}, not arm64"
    if os.uname().machine != "aarch64":
        try:
            enabled = BINFMT.read_text().splitlines()[0] == "enabled"
        except (OSError, IndexError):
            enabled = False
        if not enabled:
            return (
                f"{BINFMT} is not an enabled handler (apt-get install qemu-user-static "
                "binfmt-support; update-binfmts --enable qemu-aarch64)"
            )
    return None


@pytest.fixture
def arm64() -> Iterator[str]:
    """A unique name for the arm64 container; every container of the test is gone after."""
    reason = missing()
    if reason is not None:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true, so the mixed-architecture test must run, but: {reason}")
        pytest.skip(reason)
    name = f"asteroid-mixed-arch-{secrets.token_hex(4)}"
    try:
        yield name
    finally:
        _docker("rm", "--force", name)
        left = _docker("ps", "-a", "--filter", f"label={LABEL}", "--filter", f"name={name}", "-q")
        assert left.stdout.strip() == "", f"containers left: {left.stdout}"


def start_arm64_worker(name: str, cluster: LocalCluster, device: str) -> None:
    """The arm64 worker container, on the host's network, configured like the cluster's."""
    env = {
        "ASTEROID_REDIS_URL": cluster.env["ASTEROID_REDIS_URL"],
        "ASTEROID_CLUSTER": cluster.env["ASTEROID_CLUSTER"],
        "ASTEROID_COORDINATOR": cluster.addr,
        "ASTEROID_HEARTBEAT_S": str(HEARTBEAT_S),
        "ASTEROID_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "ASTEROID_DATA_HOST": "127.0.0.1",
        "ASTEROID_ADVERTISE_HOST": "127.0.0.1",
        "ASTEROID_DATA_PORT": "0",
        "ASTEROID_LINK_PORT": "0",
    }
    argv = ["run", "--detach", "--name", name, "--label", LABEL, "--network", "host"]
    argv += ["--platform", "linux/arm64"]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    # the machine it runs on first (qemu answers uname as the arm64 kernel would)
    command = f"uname -m && exec asteroid-worker --device {device}"
    out = _docker(*argv, IMAGE, "sh", "-c", command)
    assert out.returncode == 0, out.stderr


def wait_container(name: str, budget: Budget, cap_s: float) -> int:
    """The container's exit code; fails with its log if it still runs after the wait."""
    limit = budget.left(cap_s)
    try:
        out = _docker("wait", name, timeout_s=limit)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{name} still runs after {limit:.0f} s:\n{container_log(name)}"
        ) from None
    return int(out.stdout.strip() or -1)


def container_log(name: str, lines: int = 40) -> str:
    out = _docker("logs", "--tail", str(lines), name)
    return f"--- {name} ---\n{out.stdout}{out.stderr}"


@pytest.mark.timeout(TIMEOUT_S)
def test_an_emulated_arm64_worker_beside_amd64_workers_trains_exactly(
    tmp_path: Path, redis_url: str, cluster_name: str, budget: Budget, arm64: str
) -> None:
    started = time.monotonic()
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, HEARTBEAT_S, budget)
    # the emulated worker is slow to import torch and join: the plan waits for it
    cluster.env["ASTEROID_JOIN_TIMEOUT_S"] = str(TIMEOUT_S)
    model: dict[str, Any] = {"name": "small_cnn"}
    job = {"job_id": "eq", "model": model, "seed": 7, "rounds": ROUNDS, "optimizer": SGD}
    plan = {"global_batch": BATCH, "microbatches": 4, "stages": STAGES}
    try:
        start_arm64_worker(arm64, cluster, "arm")
        cluster.start_workers(["amd-a", "amd-b", "amd-c"])
        code = cluster.run(job, plan, timeout_s=TIMEOUT_S)
        assert code == 0, cluster.log_tail("coordinator", 60) + "\n" + container_log(arm64)
        cluster.wait_workers_exit(60)
        assert wait_container(arm64, budget, 120) == 0, container_log(arm64)
        logs = _docker("logs", arm64)
        log = logs.stdout + logs.stderr
        store = Store(redis_url, cluster_name)
        try:
            weights = load_full_state(store, "eq", ROUNDS)
            digests = checkpoint_digests(store, "eq", ROUNDS)
            metrics = store.read("metrics", "eq")
        finally:
            store.close()
    finally:
        cluster.close()
    assert log.splitlines()[0] == "aarch64", "the arm64 worker's log:\n" + log[-2000:]
    assert_replicas_agree(digests, STAGES)
    ref, ref_losses = reference_train(model, 7, BATCH, ROUNDS, SGD)
    key, diff = weight_difference(weights, ref)
    print(
        f"mixed amd64 + arm64: max-abs weight difference {diff:.3g} ({key}), "
        f"{time.monotonic() - started:.0f} s"
    )
    assert_matches_reference(weights, ref)
    assert_losses_match(losses(metrics), ref_losses)
