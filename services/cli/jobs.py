"""`asteroid train | status | cancel | drain | export`: jobs on a running coordinator.

Submission and cancelling go to the coordinator over ZeroMQ; following,
status and export read Redis. A bad job spec is refused before anything is
sent, with one error naming the field. What pulls in torch (job specs, the
wire codec, weight export) is imported inside the commands, so `asteroid
--help` does not load it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from common.errors import AsteroidError, ConfigError, DataPathError, StoreError
from common.exit_codes import ExitCode
from common.ids import DeviceId, check_job_id
from common.records.devices import read_devices
from common.records.jobs import read_job, recent_jobs
from common.settings import CommonSettings
from common.store import Store
from services.cli.console import CliConsole, shown

if TYPE_CHECKING:
    from services.cli.follow import JobView

__all__ = ["cancel", "drain", "export", "status", "store_from", "train", "view_exit_code"]

console = CliConsole()

CoordinatorOpt = Annotated[
    str | None,
    typer.Option(help="Coordinator control address (default: ASTEROID_COORDINATOR)."),
]
RedisOpt = Annotated[str | None, typer.Option(help="Redis URL (default: ASTEROID_REDIS_URL).")]
ReplyTimeout = Annotated[
    float, typer.Option(min=0.1, help="Seconds to wait for the coordinator's reply.")
]
ClusterOpt = Annotated[
    str | None, typer.Option(help="Cluster key prefix (default: ASTEROID_CLUSTER).")
]


def _settings(coordinator: str | None, redis_url: str | None, cluster: str | None) -> Any:
    overrides: dict[str, Any] = {
        k: v
        for k, v in (("coordinator", coordinator), ("redis_url", redis_url), ("cluster", cluster))
        if v
    }
    return CommonSettings(**overrides)


LOCATE_PATIENCE_S = 10.0
"""Longest the CLI waits for the coordinator to say where Redis is."""


def store_from(redis_url: str | None, cluster: str | None) -> Store:
    """The store the options (or ASTEROID_* variables) name, checked to answer.

    With no Redis URL but a coordinator or a key set configured, the
    coordinator says where Redis is, and the key set's `operator` password
    logs in (`common.locate`); with neither, the default URL is used.
    """
    s = _settings(None, redis_url, cluster)
    if "redis_url" not in s.model_fields_set and {"coordinator", "keys"} & s.model_fields_set:
        from common.curve import load_keys
        from common.locate import with_redis

        keys = load_keys(s.keys, "operator")
        s = with_redis(s, keys, "operator", patience_s=LOCATE_PATIENCE_S)
    store = Store(s.redis_url, s.cluster)
    store.ping()
    return store


def open_store(redis_url: str | None, cluster: str | None) -> Store:
    """`store_from`, or the CLI's exit (FAILED) naming why Redis cannot be reached."""
    try:
        return store_from(redis_url, cluster)
    except AsteroidError as exc:
        raise _fail(exc, ExitCode.FAILED) from exc


def _fail(exc: Exception, code: ExitCode = ExitCode.CONFIG) -> typer.Exit:
    """Print `exc` (credentials hidden) and the exit to raise."""
    if isinstance(exc, DataPathError):  # checked on this machine: the reason is the operator's
        exc = ConfigError(exc.detail)
    console.print(f"[red]error:[/red] {shown(exc)}")  # a refusal quotes the coordinator
    return typer.Exit(int(code))


def view_exit_code(view: JobView) -> ExitCode:
    """The exit code a followed job's end state maps to."""
    if view.state == "finished":
        return ExitCode.OK
    if view.state == "cancelled":
        return ExitCode.INTERRUPTED
    return ExitCode.JOB_FAILED


def train(
    job_file: Annotated[Path, typer.Argument(help="Job spec (YAML).", metavar="JOB.yaml")],
    follow_: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Show progress until the job ends.")
    ] = True,
    replace: Annotated[
        bool, typer.Option(help="Start afresh if an ended job has the same job_id.")
    ] = False,
    coordinator: CoordinatorOpt = None,
    redis_url: RedisOpt = None,
    cluster: ClusterOpt = None,
    reply_timeout: ReplyTimeout = 15.0,
) -> None:
    """Submit a job to a running coordinator and follow its progress."""
    from common.job import load_job
    from common.messages import SubmitJob
    from services.cli.client import ask_coordinator
    from services.cli.follow import follow
    from services.coordinator.checks import check_job

    s = _settings(coordinator, redis_url, cluster)
    try:
        job = load_job(job_file)
        check_job(job, s.model_modules)
        reply = ask_coordinator(s.coordinator, SubmitJob(job=job, replace=replace), reply_timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error))
    console.print(f"job [cyan]{job.job_id}[/cyan] submitted to {s.coordinator}")
    if not follow_:
        return
    store = open_store(redis_url, cluster)
    try:
        view = follow(store, job.job_id, console)
    except KeyboardInterrupt:
        console.print(f"stopped following; the job goes on (asteroid cancel {job.job_id})")
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    finally:
        store.close()
    error = f": {shown(view.error)}" if view.error else ""
    console.print(f"job {shown(job.job_id)} {shown(view.state)}{error}")
    raise typer.Exit(int(view_exit_code(view)))


def cancel(
    job_id: Annotated[str, typer.Argument(help="The job to stop.")],
    coordinator: CoordinatorOpt = None,
    reply_timeout: ReplyTimeout = 15.0,
) -> None:
    """Cancel a queued or running job (it stops at the next round boundary)."""
    from common.job import check_job_id
    from common.messages import CancelJob
    from services.cli.client import ask_coordinator

    s = _settings(coordinator, None, None)
    try:
        check_job_id(job_id, "the command line")
        reply = ask_coordinator(s.coordinator, CancelJob(job_id=job_id), reply_timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error))
    console.print(f"job {job_id}: cancel requested")


def drain(
    device: Annotated[str, typer.Argument(help="The device whose work moves away.")],
    coordinator: CoordinatorOpt = None,
    reply_timeout: ReplyTimeout = 15.0,
) -> None:
    """Move a device's work to the others at the next round boundary, then let it go.

    Nothing is replayed: the running job re-plans without it at the round it
    committed and the device's layers move to the others, peer to peer.
    """
    from common.messages import DrainDevice
    from services.cli.client import ask_coordinator

    s = _settings(coordinator, None, None)
    try:
        reply = ask_coordinator(s.coordinator, DrainDevice(target=DeviceId(device)), reply_timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error))
    console.print(f"device {shown(device)}: drain requested (job {shown(reply.job_id)})")


DEVICE_COLUMNS = (
    "device",
    "heartbeat",
    "state",
    "stage",
    "round",
    "memory",
    "threads",
    "version",
    "kind",
)
"""The devices table's columns; version is the worker's release, from its heartbeats."""


def _age(seen: float | None) -> str:
    if seen is None:
        return "-"
    return f"{max(0.0, time.time() - seen):.1f} s"


def devices_table(store: Store) -> Table:
    """Every worker that ever joined this cluster, freshest first."""
    table = Table(title="devices")
    for col in DEVICE_COLUMNS:
        table.add_column(col)
    for d in read_devices(store):  # freshest first
        table.add_row(  # each field came from a peer's heartbeat
            shown(d.device),
            _age(d.seen),
            shown(d.state or "?"),
            shown("-" if d.stage is None else d.stage),
            shown("-" if d.round is None else d.round),
            f"{d.memory_budget / (1 << 30):.2f} GiB" if d.memory_budget else "-",
            shown("-" if d.threads is None else d.threads),
            shown(d.version or "-"),
            shown(d.fingerprint),
        )
    return table


def jobs_table(store: Store, only: str | None = None) -> Table:
    """Jobs, newest first: state, progress, loss, held-out accuracy, samples/s."""
    table = Table(title="jobs")
    for col in ("job", "state", "round", "loss", "held-out acc", "samples/s", "note"):
        table.add_column(col)
    for jid in recent_jobs(store) if only is None else [only]:
        j = read_job(store, jid)
        if j is None:
            table.add_row(shown(jid), "unknown", "-", "-", "-", "-", "")
            continue
        table.add_row(
            shown(jid),
            shown(j.state),
            shown(f"{j.round or 0}/{'?' if j.total_rounds is None else j.total_rounds}"),
            "-" if j.loss is None else f"{j.loss:.4f}",
            "-" if j.eval_accuracy is None else f"{j.eval_accuracy:.1%}",
            "-" if j.samples_per_s is None else f"{j.samples_per_s:.0f}",
            shown(j.note[:60]),
        )
    return table


def status(
    job: Annotated[str | None, typer.Option(help="Show only this job.")] = None,
    redis_url: RedisOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Devices (heartbeat age, stage, memory) and jobs (state, round, samples/s)."""
    try:
        if job is not None:
            check_job_id(job, "the command line")
    except ConfigError as exc:
        raise _fail(exc) from exc
    store = open_store(redis_url, cluster)
    try:
        console.print(devices_table(store))
        console.print(jobs_table(store, job))
    except StoreError as exc:  # a record no coordinator wrote, named
        raise _fail(exc, ExitCode.FAILED) from exc
    finally:
        store.close()


def export(
    job_id: Annotated[str, typer.Argument(help="The job whose weights to write.")],
    out: Annotated[Path, typer.Option(help="Output file: .safetensors or .pt.")],
    round_no: Annotated[
        int | None,
        typer.Option("--round", help="A committed checkpoint round (default: the newest)."),
    ] = None,
    redis_url: RedisOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Write a job's checkpointed weights to a file plain PyTorch loads into the zoo model."""
    from common.job import check_job_id
    from services.lib.export import export_weights

    try:
        check_job_id(job_id, "the command line")
        store = store_from(redis_url, cluster)
        try:
            allowed = _settings(None, redis_url, cluster).model_modules
            info = export_weights(store, job_id, out, round_no, allowed)
        finally:
            store.close()
    except AsteroidError as exc:
        raise _fail(exc) from exc
    console.print(f"wrote {info.tensors} tensors of job {job_id} round {info.round} to {out}")
