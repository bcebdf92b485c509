"""`asteroid up` and `asteroid demo`: a whole cluster on this machine, in the foreground.

`up` runs Redis, the four services and N workers until Ctrl-C (optionally
training one job); `demo` does the same for the example job and then
reports: the plan, where each stage's time went, measured throughput next
to the simulator's, the timeline picture and the exported weights. Either
way every child process is stopped on the way out. The embedded Redis keeps
its append-only file in a state folder, so what a run committed is still
there when the next one starts. While it runs, the command holds that
folder's lock and says in its cluster file where the cluster is
(`common.local_cluster`): every other CLI command finds it from there, and a
second `up` on the same folder refuses instead of loading the live AOF.

Imports that pull in torch, redis or the settings wait inside the functions, so
`asteroid --help` and every other command stay quick on a small device.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError

from common.errors import AsteroidError, ConfigError, validation_message
from common.secrets import mask_url
from services.cli.console import CliConsole, shown
from services.cli.example_files import DEMO_JOB, example_path
from services.cli.foreground import STOP, foreground

if TYPE_CHECKING:
    from common.job import JobSpec
    from common.local_cluster import StateClaim
    from common.store import Store
    from services.launcher import LocalStack

__all__ = ["demo", "up"]

console = CliConsole(soft_wrap=True)
"""Never wraps a line: what `up` prints (addresses, errors) stays copyable in a log."""


Workers = Annotated[int, typer.Option(min=1, max=16, help="Worker processes to start.")]
Threads = Annotated[int, typer.Option(min=1, help="Torch threads per worker.")]
Logs = Annotated[Path, typer.Option(help="Folder for each service's log file.")]
RedisUrl = Annotated[
    str | None, typer.Option(help="Use this Redis instead of starting an embedded one.")
]
Cluster = Annotated[str, typer.Option(help="Key prefix of this cluster in Redis.")]
StateDir = Annotated[
    Path | None,
    typer.Option(
        help="This cluster's state folder: its lock, cluster.json (where other commands find "
        "it) and the embedded Redis's append-only file in redis/ (default "
        "$XDG_STATE_HOME/asteroid). One running cluster per folder."
    ),
]
LISTEN_PATIENCE_S = 60.0
"""Longest wait for the coordinator to listen before the cluster counts as up."""


@contextlib.contextmanager
def _redis(redis_url: str | None, folder: Path) -> Iterator[str]:
    """The Redis URL to use: `redis_url`, else an embedded Redis persisting to `folder`/redis."""
    from common.embedded_redis import EmbeddedRedis

    if redis_url is not None:
        yield redis_url
        return
    with EmbeddedRedis(state_dir=folder / "redis") as server:
        console.print(f"embedded Redis keeps its data in {folder / 'redis'}/")
        yield server.url


def _wait_listening(stack: LocalStack) -> None:
    """Return once the coordinator accepts connections; a service that died raises."""
    from common.local_cluster import tcp_listening

    deadline = time.monotonic() + LISTEN_PATIENCE_S
    while not tcp_listening(stack.coordinator, 0.5):
        stack.check()
        if STOP.is_set():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            raise AsteroidError(
                f"the coordinator did not listen at {stack.coordinator} within "
                f"{LISTEN_PATIENCE_S:.0f} s:\n{stack.tail('coordinator')}"
            )
        time.sleep(0.1)


@contextlib.contextmanager
def _local_cluster(
    workers: int,
    logs: Path,
    redis_url: str | None,
    cluster: str,
    threads: int,
    state_dir: Path | None,
) -> Iterator[LocalStack]:
    """A running stack that owns `state_dir` (locked) and says where it is in its cluster file.

    The lock comes first: a second `up` on the folder must refuse before its
    Redis loads the first one's append-only file.
    """
    from common.local_cluster import claim_state_dir, default_state_dir
    from services.launcher import LocalStack

    folder = state_dir or default_state_dir()
    with (
        claim_state_dir(folder) as claim,
        _redis(redis_url, folder) as url,
        LocalStack(workers, logs, url, cluster, threads) as stack,
    ):
        _wait_listening(stack)
        _publish(claim, stack, folder)
        yield stack


def _publish(claim: StateClaim, stack: LocalStack, folder: Path) -> None:
    """Write where `stack` is into the claimed folder's cluster file, for other commands."""
    from common.local_cluster import LocalCluster

    try:
        here = LocalCluster(
            coordinator=stack.coordinator,
            redis_url=stack.redis_url,
            cluster=stack.cluster,
            pid=os.getpid(),
            state_dir=folder,
            started_at=time.time(),
        )
    except ValidationError as exc:  # a --cluster or --redis-url other commands cannot use
        raise ConfigError(
            f"other commands could not find this cluster: {validation_message(exc)}"
        ) from None
    claim.publish(here)


def _submit_hint(stack: LocalStack, state_dir: Path | None) -> str:
    """How to submit to this cluster from another terminal, on one line.

    With the default state folder every command finds the cluster by itself;
    with another one it must be told where the cluster is.
    """
    from common.local_cluster import default_state_dir

    if state_dir is None or state_dir.resolve() == default_state_dir().resolve():
        return "submit with: asteroid train JOB.yaml (from another terminal; status too)"
    return (
        f"submit with: ASTEROID_COORDINATOR={stack.coordinator} "
        f"ASTEROID_REDIS_URL={mask_url(stack.redis_url)} ASTEROID_CLUSTER={stack.cluster} "
        "asteroid train JOB.yaml"
    )


def up(
    workers: Workers = 4,
    threads: Threads = 1,
    job: Annotated[Path | None, typer.Option(help="Also train this job (YAML).")] = None,
    logs: Logs = Path("asteroid-logs"),
    redis_url: RedisUrl = None,
    cluster: Cluster = "local",
    state_dir: StateDir = None,
    homes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Run a federation of this many homes instead (the shipped federation "
            "example; each home a coordinator and --workers workers on its own prefix).",
        ),
    ] = None,
) -> None:
    """Run a whole local cluster in the foreground until Ctrl-C (or until --job ends)."""
    from services.cli.follow import load_checked, submit_and_follow
    from services.cli.jobs import view_exit_code

    with foreground(console, "interrupted; every process of the cluster is stopped"):
        if homes is not None:
            _up_homes(homes, workers, threads, logs, state_dir, job, redis_url)
            return
        spec = load_checked(job, workers) if job else None
        with _local_cluster(workers, logs, redis_url, cluster, threads, state_dir) as stack:
            redis_shown = mask_url(stack.redis_url)  # a --redis-url password stays off the screen
            console.print(  # one line each (the console never wraps): copyable from a log
                f"cluster up: coordinator {stack.coordinator}, Redis {redis_shown}, "
                f"{workers} workers; logs in {logs}/"
            )
            console.print(_submit_hint(stack, state_dir))
            if spec is not None:
                view = submit_and_follow(
                    stack.coordinator, stack.redis_url, stack.cluster, spec, console
                )
                console.print(f"job {shown(spec.job_id)} {shown(view.state)} {shown(view.error)}")
                raise typer.Exit(int(view_exit_code(view)))
            while not STOP.is_set():
                stack.check()
                time.sleep(0.5)


def _up_homes(
    homes: int,
    workers: int,
    threads: int,
    logs: Path,
    state_dir: Path | None,
    job: Path | None,
    redis_url: str | None,
) -> None:
    """`up --homes N`: the federation of `services.cli.homes`, holding the state folder.

    Its embedded Redis keeps its data where a plain `up`'s would (STATE/redis),
    so the lock keeps the two from sharing a live append-only file.
    """
    from common.local_cluster import claim_state_dir, default_state_dir
    from services.cli.homes import up_homes

    if job is not None or redis_url is not None:
        raise ConfigError(
            "--homes runs the shipped federation example on its own Redis: "
            "--job and --redis-url do not go with it"
        )
    folder = state_dir or default_state_dir()
    with claim_state_dir(folder) as claim:  # other commands find home 0 (`status`, `federation`)
        up_homes(
            homes, workers, threads, logs, folder / "redis",
            publish=lambda stack: _publish(claim, stack, folder),
        )  # fmt: skip


def demo(
    workers: Workers = 4,
    threads: Threads = 1,
    job: Annotated[
        Path | None,
        typer.Option(
            help=f"Job spec (YAML); default: the shipped {DEMO_JOB} (`asteroid examples` "
            "writes it out to edit)."
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for the timeline, weights and logs.")] = Path(
        "demo-output"
    ),
    redis_url: RedisUrl = None,
    cluster: Cluster = "demo",
    state_dir: StateDir = None,
) -> None:
    """The quick start: a local cluster trains the example job, reports, and stops."""
    from common.store import Store
    from services.cli.follow import load_checked, submit_and_follow
    from services.cli.jobs import view_exit_code

    t0 = time.monotonic()
    with foreground(console, "interrupted; every process of the demo is stopped"):
        with example_path(DEMO_JOB) if job is None else contextlib.nullcontext(job) as path:
            spec = load_checked(path, workers)
        with _local_cluster(workers, out / "logs", redis_url, cluster, threads, state_dir) as stack:
            console.print(
                f"[bold]Asteroid-Edge demo[/bold]: Redis, coordinator, planner, profiler and "
                f"{workers} workers as separate processes (logs in {out}/logs)"
            )
            # the quick start trains its example afresh: an earlier demo's run is replaced
            view = submit_and_follow(
                stack.coordinator, stack.redis_url, stack.cluster, spec, console, replace=True
            )
            if view.state != "finished":
                console.print(f"[red]job {shown(view.state)}[/red]: {shown(view.error)}")
                raise typer.Exit(int(view_exit_code(view)))
            _report(Store(stack.redis_url, stack.cluster), spec, out)
    console.print(f"done in {time.monotonic() - t0:.0f} s; everything stopped")


def _report(store: Store, job: JobSpec, out: Path) -> None:
    """Print the plan and the measured-versus-simulated summary; write timeline and weights."""
    from common.extras import installed_extras
    from services.cli.plan import plan_table
    from services.cli.report import job_report, stage_table, summary_table
    from services.lib.export import export_weights
    from services.planner.timeline import draw_timeline

    try:
        rep = job_report(store, job.job_id)
        timeline = None
        if rep.sim is not None and installed_extras()["plots"]:
            timeline = out / "timeline.png"
            draw_timeline(rep.sim, rep.plan, timeline, title=f"{rep.plan.planner}: simulated round")
        elif rep.sim is not None:  # a base install: the rest of the report needs no picture
            console.print(
                "no timeline picture: pip install 'asteroid-edge[plots]' for one", markup=False
            )
        if rep.sim is not None and rep.cost is not None:
            console.print(plan_table(rep.plan, rep.sim, rep.cost))
        console.print(stage_table(rep))
        console.print(summary_table(rep, timeline))
        info = export_weights(store, job.job_id, out / "weights.safetensors")
        console.print(f"final weights (round {info.round}) written to {info.path}")
    finally:
        store.close()
