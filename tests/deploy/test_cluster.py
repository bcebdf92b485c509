"""`make deploy` over a real ssh path: trains like the reference, idempotent, removable.

Three emulated devices (a control device and two workers, each a network
namespace with its own sshd) get the cluster from `make deploy`; the real
`asteroid train` trains a small job through the deployed coordinator, and the
exported weights must equal single-process training of the same job (1e-6).
A second `make deploy` must change nothing and keep every container, and
`make undeploy` must leave no container, volume, shipped file or image of
ours. Whatever happens, the finally-block removes containers, volumes and
files by the cluster's name, and the `devices` fixture namespaces, sshd
processes and the FORWARD rule.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from common.ports import free_port
from services.cli.deploy import ACL_TEMPLATE as ACL
from services.cli.deploy import DEFAULT_TAG
from services.deploy.apply import Deployment
from services.deploy.inventory import load_inventory
from tests.deploy.sshdevices import SshDevices
from tests.reference import assert_matches_reference, reference_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ASTEROID = str(Path(sys.executable).with_name("asteroid"))
ROUNDS = 4
SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
JOB: dict[str, Any] = {
    "job_id": "deployed",
    "model": {"name": "small_cnn"},
    "global_batch": 32,
    "micro_batch": 8,
    "rounds": ROUNDS,
    "seed": 5,
    "optimizer": SGD,
    "planner": "asteroid",
    "min_workers": 2,
}


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> str:
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    assert out.returncode == 0, f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def docker_lines(*args: str) -> list[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)
    return [line for line in out.stdout.splitlines() if line.strip()]


def inventory(devs: SshDevices, cluster: str, remote: Path) -> dict[str, Any]:
    host = devs.bridge_ip
    # one torch thread per worker, as the local equivalence tests run them: the same sums
    common = {"ssh_identity": str(devs.client_key), "cpus": 1, "threads": 1}
    devices: list[dict[str, Any]] = [
        {"name": "ctl", "host": devs.addresses["ctl"], "roles": ["control"], "memory": "1GiB"},
    ]
    for name in ("w1", "w2"):
        ports = {"data_port": free_port(host), "link_port": free_port(host)}
        devices.append(
            {"name": name, "host": devs.addresses[name], "roles": ["worker"], "memory": "1GiB"}
            | ports
        )
    return {
        "cluster": cluster,
        "coordinator_host": host,  # containers run in the root namespace: the bridge's side
        "coordinator_port": free_port(host),
        "redis_port": free_port(host),
        "remote_dir": str(remote),
        "known_hosts": str(devs.known_hosts),
        "devices": [common | d for d in devices],
    }


def wait_healthy(inv_file: Path, keys: Path, timeout_s: float = 240) -> None:
    """Until every service of every device runs and its healthcheck passes."""
    deployment = Deployment(load_inventory(inv_file), keys, DEFAULT_TAG, ACL.read_text())
    deadline = time.monotonic() + timeout_s
    while True:
        rows = deployment.status()
        if len(rows) == 7 and all(r.state == "running" and r.health == "healthy" for r in rows):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not all healthy within {timeout_s:.0f} s: {rows}")
        time.sleep(2)


def container_logs(cluster: str) -> str:
    names = docker_lines(
        "ps", "-a", "--filter", f"label=asteroid.cluster={cluster}", "--format", "{{.Names}}"
    )
    parts = []
    for n in names:
        out = subprocess.run(
            ["docker", "logs", "--tail", "20", n], capture_output=True, text=True, timeout=30
        )
        parts.append(f"--- {n}\n{(out.stdout + out.stderr)[-2000:]}")
    return "\n".join(parts)


def operator_env(args: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    lines = run([ASTEROID, "deploy", "env", *args]).splitlines()
    for line in lines:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    return env


def remove_everything(cluster: str, remote: Path) -> None:
    """The finally-block's cleanup: by the cluster's name, whatever state the test left."""
    ids = docker_lines("ps", "-aq", "--filter", f"label=asteroid.cluster={cluster}")
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120)
    vols = [v for v in docker_lines("volume", "ls", "-q") if v.startswith(f"asteroid-{cluster}-")]
    if vols:
        subprocess.run(["docker", "volume", "rm", "-f", *vols], capture_output=True, timeout=60)
    shutil.rmtree(remote, ignore_errors=True)


@pytest.mark.timeout(900)
def test_make_deploy_trains_like_the_reference_redeploys_nothing_and_undeploys_all(
    images: None, devices: SshDevices, tmp_path: Path, tag: str
) -> None:
    cluster = f"dt{tag}"
    remote = tmp_path / "remote"
    keys = tmp_path / "keys"
    names = ["--worker", "w1", "--worker", "w2", "--service", "planner", "--service", "profiler"]
    run([ASTEROID, "keys", "init", str(keys), *names, "--operator", "op"])
    inv_file = tmp_path / "devices.yaml"
    inv_file.write_text(yaml.safe_dump(inventory(devices, cluster, remote)))
    args = [f"INVENTORY={inv_file}", f"KEYS={keys}"]
    cli_args = ["--inventory", str(inv_file), "--keys", str(keys)]
    images_before = set(docker_lines("images", "-q", "--no-trunc"))
    figures: dict[str, float] = {}
    try:
        started = time.monotonic()
        out = run(["make", "deploy", *args])
        figures["first deploy s"] = time.monotonic() - started
        changes = int(re.search(r"(\d+) changes in", out).group(1))  # type: ignore[union-attr]
        assert changes > 0 and "run-container asteroid-" in out, out
        assert "ship-image" not in out  # the devices' engine is this one: it has the images
        try:
            wait_healthy(inv_file, keys)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{container_logs(cluster)}") from None
        status = run(["make", "deploy-status", *args])
        assert status.count("current") == 7, status

        job_file = tmp_path / "job.yaml"
        job_file.write_text(yaml.safe_dump(JOB))
        env = operator_env(cli_args)
        started = time.monotonic()
        try:
            run([ASTEROID, "train", str(job_file)], env=env, timeout=600)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{container_logs(cluster)}") from None
        figures["job s"] = time.monotonic() - started
        weights_file = tmp_path / "weights.safetensors"
        run([ASTEROID, "export", JOB["job_id"], "--out", str(weights_file)], env=env)
        ref, _ = reference_train(JOB["model"], JOB["seed"], JOB["global_batch"], ROUNDS, SGD)
        assert_matches_reference(load_file(str(weights_file)), ref)

        ids = docker_lines(
            "ps", "-q", "--no-trunc", "--filter", f"label=asteroid.cluster={cluster}"
        )
        assert len(ids) == 7
        started = time.monotonic()
        again = run(["make", "deploy", *args])
        figures["second deploy s"] = time.monotonic() - started
        assert re.search(r"^0 changes in", again, re.M), again
        after = docker_lines(
            "ps", "-q", "--no-trunc", "--filter", f"label=asteroid.cluster={cluster}"
        )
        assert sorted(after) == sorted(ids)

        down = run(["make", "undeploy", *args])
        assert "remove-container" in down and "remove-dir" in down
        assert docker_lines("ps", "-aq", "--filter", f"label=asteroid.cluster={cluster}") == []
        assert [v for v in docker_lines("volume", "ls", "-q") if cluster in v] == []
        assert not (remote / cluster).exists()
        # no image was shipped (this engine had them), so every image here before is here still
        assert images_before <= set(docker_lines("images", "-q", "--no-trunc"))
    finally:
        remove_everything(cluster, remote)
        print(json.dumps({k: round(v, 1) for k, v in figures.items()}))
    assert docker_lines("ps", "-aq", "--filter", f"label=asteroid.cluster={cluster}") == []
    with contextlib.suppress(FileNotFoundError):
        assert list(remote.iterdir()) == []
