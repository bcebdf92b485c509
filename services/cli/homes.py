"""A federation of N homes on one machine: what `asteroid up --homes N` runs.

One embedded Redis holds every home (each its own cluster prefix, `home-0`...)
and the federation (prefix `federation`); `asteroid-federation` serves the shipped
`federation-digits.yaml`, and each home is a whole local stack (coordinator,
planner, profiler, workers) that trains its share of the shipped `home-digits.yaml`.
The files each one runs are written, already fitted to the N homes started (homes,
home index, the federation's address), next to the logs; nothing needs editing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from common.embedded_redis import EmbeddedRedis
from common.entry_points import service_command
from common.errors import ConfigError
from common.ports import free_port
from common.procs import spawn, stop_all
from common.store import Store
from services.cli.console import CliConsole
from services.cli.example_files import example_path
from services.cli.foreground import STOP
from services.launcher import LocalStack, check_alive, service_env

__all__ = ["FEDERATION_PREFIX", "fitted_files", "home_prefix", "up_homes"]

console = CliConsole()

FEDERATION_SPEC = "federation-digits.yaml"
HOME_JOB = "home-digits.yaml"
FEDERATION_PREFIX = "federation"
"""The Redis cluster prefix of the federation's own records (`asteroid federation`)."""

SUBMIT_TIMEOUT_S = 60.0
"""Longest wait for a home's coordinator to take its job (it may still be starting)."""


def home_prefix(home: int) -> str:
    """The Redis cluster prefix of home `home`."""
    return f"home-{home}"


def _example(name: str) -> dict[str, Any]:
    with example_path(name) as path:
        data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"the shipped example {name} is not a mapping")
    return data


def fitted_files(
    homes: int, address: str, updates: int | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The example federation spec and one home job per home, fitted to `homes` homes.

    What a person edited by hand before: the number of homes in both files, each
    home's index (its share of the data and its name to the federation), its job
    id, and where the federation listens. `updates` shortens the federation.
    """
    if homes < 1:
        raise ConfigError(f"--homes must be at least 1, got {homes}")
    spec = _example(FEDERATION_SPEC) | {"homes": homes}
    if updates is not None:
        spec["updates"] = updates
    jobs = []
    for h in range(homes):
        job = _example(HOME_JOB)
        job["job_id"] = f"home{h}"
        job["dataset"] = {**job["dataset"], "homes": homes, "home": h}
        job["federation"] = {
            **job["federation"],
            "federation_id": spec["federation_id"],
            "address": address,
            "home": h,
        }
        jobs.append(job)
    return spec, jobs


def _write(path: Path, data: dict[str, Any], what: str) -> Path:
    path.write_text(f"# {what}\n" + yaml.safe_dump(data, sort_keys=False))
    return path


def _submit(stack: LocalStack, path: Path, workers: int) -> None:
    """Hand a home its job; its coordinator may still be binding, so the wait is long."""
    from common.messages import SubmitJob
    from services.cli.client import ask_coordinator
    from services.cli.follow import load_checked

    job = load_checked(path, workers)
    reply = ask_coordinator(stack.coordinator, SubmitJob(job=job, replace=True), SUBMIT_TIMEOUT_S)
    if not reply.ok:
        raise ConfigError(f"{stack.cluster} refused its job {path}: {reply.error}")


def _progress(store: Store, fid: str, last: str) -> str:
    """Print the federation's state when it changed; returns what was printed."""
    fields = store.get_fields("fl", fid)
    if not fields:
        return last
    now = f"{fields.get('state')} v{fields.get('version')}"
    if now != last:
        console.print(
            f"federation {fid}: {fields.get('state')}, version {fields.get('version')}, "
            f"held-out accuracy {float(fields.get('accuracy', -1.0)):.3f}",
            soft_wrap=True,
        )
    return now


def up_homes(
    homes: int,
    workers: int,
    threads: int,
    logs: Path,
    state_dir: Path | None,
    *,
    updates: int | None = None,
    publish: Callable[[LocalStack], object] | None = None,
) -> None:
    """Run the example federation with `homes` homes of `workers` workers until Ctrl-C.

    Args:
        homes: Homes to start (the federation's `homes`).
        workers: Workers per home.
        threads: Torch threads of every worker and profiler.
        logs: Folder of every process's log and of the fitted spec files.
        state_dir: Where Redis keeps its data (None: in memory); every start runs
            the federation afresh either way (`replace`).
        updates: Global versions to run (None: the example's).
        publish: Called with home 0's stack once every home has its job, so that
            `asteroid up` can tell other commands where the cluster is (its cluster file).

    Raises:
        ConfigError: A bad count, or a home refused its job.
        ServiceDied: A process exited on its own (its log's tail in the message).
        KeyboardInterrupt: Ctrl-C, after which everything is stopped.

    """
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    logs.mkdir(parents=True, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    spec, jobs = fitted_files(homes, address, updates)
    fid = str(spec["federation_id"])
    spec_file = _write(logs / "federation.yaml", spec, f"{FEDERATION_SPEC} for {homes} homes")
    job_files = [
        _write(logs / f"home-{h}.yaml", job, f"{HOME_JOB} for home {h} of {homes}")
        for h, job in enumerate(jobs)
    ]
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(EmbeddedRedis(state_dir=state_dir))
        env = service_env(redis.url, FEDERATION_PREFIX, "", 0.5, threads)
        del env["ASTEROID_COORDINATOR"]  # the federation has none; homes have their own
        cmd = [*service_command("federation"), "--spec", str(spec_file), "--bind", address]
        fed = spawn([*cmd, "--replace"], env, logs / "federation.log")
        stack.callback(stop_all, [fed])
        homes_up = []
        for h in range(homes):
            home = LocalStack(workers, logs / home_prefix(h), redis.url, home_prefix(h), threads)
            homes_up.append(stack.enter_context(home))
        for home, path in zip(homes_up, job_files, strict=True):
            _submit(home, path, workers)
        if publish is not None:
            publish(homes_up[0])
        _tell(homes, workers, redis.url, address, logs, fid)
        store = stack.enter_context(contextlib.closing(Store(redis.url, FEDERATION_PREFIX)))
        last = ""
        while not STOP.is_set():
            check_alive("the federation", fed, logs / "federation.log")
            for home in homes_up:
                home.check()
            last = _progress(store, fid, last)
            time.sleep(0.5)


def _tell(homes: int, workers: int, redis_url: str, address: str, logs: Path, fid: str) -> None:
    """What runs and how to look at it, one unwrapped line each (logs stay copyable)."""
    lines = [
        f"federation {fid} up: asteroid-federation at {address}, {homes} homes of {workers} "
        f"workers, Redis {redis_url}; logs and the fitted files in {logs}/",
        f"each home trains {logs}/home-N.yaml on cluster prefix home-N; "
        f"the federation runs {logs}/federation.yaml",
        f"watch: asteroid federation {fid} --redis-url {redis_url} --cluster {FEDERATION_PREFIX}",
        f"a home: asteroid status --redis-url {redis_url} --cluster {home_prefix(0)}",
        f"the global model: asteroid federation {fid} --out global.safetensors "
        f"--redis-url {redis_url} --cluster {FEDERATION_PREFIX}",
        "Ctrl-C stops every process",
    ]
    for line in lines:
        console.print(line, soft_wrap=True)
