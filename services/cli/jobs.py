"""`asteroid train | status | cancel | drain | export`: jobs on a running coordinator.

Submission and cancelling go to the coordinator over ZeroMQ; following,
status and export read Redis. Where both are comes from the options, else
ASTEROID_* variables, else the cluster `asteroid up` runs on this machine
(`common.local_cluster.resolve`); with none of these and nothing answering at
the defaults, a command says so at once instead of waiting out a timeout.
A bad job spec is refused before anything is sent, with one error naming the
field. What pulls in torch (job specs, the wire codec, weight export), and what only
some commands need (redis, the settings) is imported inside the commands, so
every `asteroid` start, `--help` included, loads neither.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from common.errors import (
    AsteroidError,
    ConfigError,
    DataPathError,
    StoreError,
    Unreachable,
)
from common.exit_codes import ExitCode
from common.ids import DeviceId, check_job_id
from services.cli.console import CliConsole, shown
from services.cli.failure import fail

if TYPE_CHECKING:
    from common.local_cluster import Resolved
    from common.records.devices import DeviceRecord
    from common.settings import CommonSettings
    from common.store import Store
    from services.cli.follow import JobView

__all__ = [
    "NO_CLUSTER",
    "NoClusterFound",
    "cancel",
    "coordinator_of",
    "drain",
    "export",
    "open_store",
    "status",
    "store_from",
    "train",
    "view_exit_code",
]

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


NO_CLUSTER = (
    "no cluster found: start one with `asteroid up` (every command then finds it), or name "
    "one with ASTEROID_COORDINATOR and ASTEROID_REDIS_URL (or --coordinator, --redis-url)"
)


class NoClusterFound(Unreachable):
    """No option, variable or local cluster names a cluster, and none answers at the defaults.

    Said at once, not after a request's whole timeout.
    """

    def __init__(self) -> None:
        super().__init__(NO_CLUSTER)


def _resolve(coordinator: str | None, redis_url: str | None, cluster: str | None) -> Resolved:
    """`resolve`, or the CLI's exit (CONFIG) when the local cluster's file is unusable."""
    from common.local_cluster import resolve

    try:
        return resolve(coordinator, redis_url, cluster)
    except ConfigError as exc:
        raise _fail(exc) from exc


def _nothing_named(res: Resolved) -> bool:
    """Whether neither an option, a variable nor a local cluster named where the cluster is."""
    return res.origin["coordinator"] == res.origin["redis_url"] == "default"


def _coordinator(res: Resolved) -> str:
    """The coordinator to ask; NoClusterFound at once when none is named and none listens."""
    from common.local_cluster import tcp_listening

    address = res.settings.coordinator
    if res.origin["coordinator"] == "default" and tcp_listening(address) is False:
        raise NoClusterFound
    return address


def coordinator_of(coordinator: str | None) -> str:
    """The coordinator a command asks: the option, ASTEROID_COORDINATOR, the local cluster.

    Raises:
        NoClusterFound: At once, when none of them names one and none listens at the default.

    """
    return _coordinator(_resolve(coordinator, None, None))


LOCATE_PATIENCE_S = 10.0
"""Longest the CLI waits for the coordinator to say where Redis is."""


def store_from(redis_url: str | None, cluster: str | None, coordinator: str | None = None) -> Store:
    """The store the options, ASTEROID_* variables or the local cluster name, checked to answer.

    With no Redis URL but a coordinator or a key set configured, the
    coordinator says where Redis is, and the key set's `operator` password
    logs in (`common.locate`); with neither, the default URL is used.
    """
    from common.local_cluster import resolve

    return _store(resolve(coordinator, redis_url, cluster).settings)


def _store(s: CommonSettings) -> Store:
    from common.store import Store

    if "redis_url" not in s.model_fields_set and {"coordinator", "keys"} & s.model_fields_set:
        from common.curve import load_keys
        from common.locate import with_redis

        keys = load_keys(s.keys, "operator")
        s = with_redis(s, keys, "operator", patience_s=LOCATE_PATIENCE_S)
    store = Store(s.redis_url, s.cluster)
    store.ping()
    return store


def open_store(redis_url: str | None, cluster: str | None, coordinator: str | None = None) -> Store:
    """`store_from`, or the CLI's exit (UNREACHABLE) naming why Redis cannot be reached.

    When nothing named a cluster, the reason is that: `NO_CLUSTER`.
    """
    return _open(_resolve(coordinator, redis_url, cluster))


def _open(res: Resolved) -> Store:
    try:
        return _store(res.settings)
    except AsteroidError as exc:
        raise _fail(NoClusterFound() if _nothing_named(res) else exc) from exc


def _fail(exc: Exception, code: ExitCode | None = None) -> typer.Exit:
    """Print `exc` (credentials hidden) on stderr; the exit to raise.

    Default code: UNREACHABLE for a Redis or coordinator that did not answer,
    else CONFIG (a refusal, a job or checkpoint that is not there).
    """
    if isinstance(exc, DataPathError):  # checked on this machine: the reason is the operator's
        exc = ConfigError(exc.detail)
    if code is None:
        code = ExitCode.UNREACHABLE if isinstance(exc, Unreachable) else ExitCode.CONFIG
    return fail(exc, code)


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

    res = _resolve(coordinator, redis_url, cluster)
    try:
        job = load_job(job_file)
        # no cluster is said before the model check loads torch and builds the model
        address = _coordinator(res)
        from common.messages import SubmitJob
        from services.cli.client import ask_coordinator
        from services.coordinator.checks import check_job

        check_job(job, res.settings.model_modules)
        reply = ask_coordinator(address, SubmitJob(job=job, replace=replace), reply_timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error))
    console.print(f"job [cyan]{job.job_id}[/cyan] submitted to {address}")
    if not follow_:
        return
    from services.cli.follow import follow

    store = _open(res)
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

    res = _resolve(coordinator, None, None)
    try:
        check_job_id(job_id, "the command line")
        reply = ask_coordinator(_coordinator(res), CancelJob(job_id=job_id), reply_timeout)
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

    res = _resolve(coordinator, None, None)
    try:
        target = DrainDevice(target=DeviceId(device))
        reply = ask_coordinator(_coordinator(res), target, reply_timeout)
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


def heartbeat_limits(s: CommonSettings) -> tuple[float, float]:
    """Heartbeat ages (silent, stale) past which `status` stops trusting a device's state.

    The coordinator's own: it suspects a worker after heartbeat_misses missed
    heartbeats and forgets one after device_expiry_s (its defaults; the
    heartbeat interval as this command's settings say).
    """
    from common.settings import CoordinatorSettings

    fields = CoordinatorSettings.model_fields
    silent = s.heartbeat_s * float(fields["heartbeat_misses"].default)
    return silent, max(float(fields["device_expiry_s"].default), silent)


def devices_table(
    store: Store,
    devices: list[DeviceRecord] | None = None,
    limits: tuple[float, float] | None = None,
) -> Table:
    """Every worker with a record in this cluster (`read_devices` by default), freshest first.

    A device silent for too long shows "silent" or "stale" (`shown_state`),
    not the state its last heartbeat claimed.
    """
    from common.records.devices import read_devices, shown_state
    from common.settings import CommonSettings

    silent_s, stale_s = limits or heartbeat_limits(CommonSettings())
    now = time.time()
    table = Table(title="devices")
    for col in DEVICE_COLUMNS:
        table.add_column(col)
    for d in read_devices(store) if devices is None else devices:  # freshest first
        table.add_row(  # each field came from a peer's heartbeat
            shown(d.device),
            _age(d.seen),
            shown(shown_state(d, now, silent_s, stale_s)),
            shown("-" if d.stage is None else d.stage),
            shown("-" if d.round is None else d.round),
            f"{d.memory_budget / (1 << 30):.2f} GiB" if d.memory_budget else "-",
            shown("-" if d.threads is None else d.threads),
            shown(d.version or "-"),
            shown(d.fingerprint),
        )
    return table


def jobs_table(store: Store, only: str | None = None, jobs: Sequence[str] | None = None) -> Table:
    """Jobs, newest first: state, progress, loss, held-out accuracy, samples/s."""
    from common.records.jobs import read_job, recent_jobs

    table = Table(title="jobs")
    for col in ("job", "state", "round", "loss", "held-out acc", "samples/s", "note"):
        table.add_column(col)
    if jobs is None:
        jobs = recent_jobs(store) if only is None else [only]
    for jid in jobs:
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
    """Devices (heartbeat age, state, stage, memory) and jobs (state, round, samples/s).

    Each active job also gets a line with its detection timeouts in force (derived
    from what the coordinator measures) and where each came from. An empty cluster
    gets a line saying which cluster and Redis were looked at and how to look
    elsewhere: a wrong prefix or URL otherwise looks exactly like a cluster with
    nothing in it.
    """
    from common.records.devices import read_devices
    from common.records.jobs import recent_jobs
    from services.cli.detection import detection_lines

    try:
        if job is not None:
            check_job_id(job, "the command line")
    except ConfigError as exc:
        raise _fail(exc) from exc
    res = _resolve(None, redis_url, cluster)
    store = _open(res)
    try:
        devices = read_devices(store)
        jobs: Sequence[str] = recent_jobs(store) if job is None else [job]
        console.print(devices_table(store, devices, heartbeat_limits(res.settings)))
        console.print(jobs_table(store, jobs=jobs))
        for line in detection_lines(store, jobs):
            console.print(line, soft_wrap=True)
    except StoreError as exc:  # a record no coordinator wrote, named
        raise _fail(exc, ExitCode.FAILED) from exc
    finally:
        store.close()
    if not devices and not jobs:
        console.print(_empty_hint(res), soft_wrap=True)


def _empty_hint(res: Resolved) -> str:
    """What an empty `status` says: where it looked, and what to do next."""
    if res.local is not None:
        return (
            f"no devices and no jobs yet in {res.where()}: its workers join within seconds; "
            "submit with `asteroid train JOB.yaml`."
        )
    return (
        f"nothing here: no devices and no jobs in {res.where()}. Start a cluster with "
        "`asteroid up`, or look elsewhere with --redis-url and --cluster "
        "(ASTEROID_REDIS_URL, ASTEROID_CLUSTER)."
    )


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
    from common.local_cluster import resolve
    from services.lib.export import export_weights

    try:
        check_job_id(job_id, "the command line")
        s = resolve(None, redis_url, cluster).settings
        store = _store(s)
        try:
            allowed = s.model_modules
            info = export_weights(store, job_id, out, round_no, allowed)
        finally:
            store.close()
    except AsteroidError as exc:
        raise _fail(exc) from exc
    console.print(f"wrote {info.tensors} tensors of job {job_id} round {info.round} to {out}")
