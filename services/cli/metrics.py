"""`asteroid export-metrics`: a job's metrics from Redis to CSV and TensorBoard files.

Writes the files the coordinator's `metrics_dir` streams while a job trains,
laid out the same way (`common.metrics_files`), from the job's `metrics`
stream: any time later, for any job Redis still holds, running or ended.
Nothing here loads torch until a command runs (TensorBoard's writer does), nor
redis and the file writers: every `asteroid` start imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from common.errors import AsteroidError, ConfigError, StoreError, StoreUnavailable
from common.exit_codes import ExitCode
from services.cli import failure
from services.cli.console import CliConsole
from services.cli.jobs import ClusterOpt, RedisOpt, store_from

if TYPE_CHECKING:
    from common.store import Store

__all__ = ["FORMATS", "export_metrics", "parse_formats", "read_records"]

FORMATS = ("csv", "tensorboard")
"""What `--format` may name."""

console = CliConsole()


def fail(exc: Exception, code: ExitCode | None = None) -> typer.Exit:
    """Print `exc` on one line of stderr (credentials hidden); the exit to raise.

    The code is `code`, else the exit-code table's for `exc` (`services.cli.failure`).
    """
    return failure.fail(exc, code)


def parse_formats(text: str) -> list[str]:
    """The formats a comma-separated `--format` value names, each once, in FORMATS order."""
    names = {part.strip().lower() for part in text.split(",") if part.strip()}
    unknown = sorted(names - set(FORMATS))
    if unknown or not names:
        raise ConfigError(
            f"--format: expected a comma-separated list of {', '.join(FORMATS)}, got {text!r}"
        )
    return [f for f in FORMATS if f in names]


def read_records(store: Store, job_id: str) -> list[dict[str, Any]]:
    """Every metrics record of `job_id`, oldest first, each with the wall-clock `time` it was made.

    A record written before records carried their `time` gets its stream
    entry's (see `common.records.metrics.read_metrics`).
    """
    from common.records.metrics import read_metrics

    return [entry.fields() for entry in read_metrics(store, job_id)]


def export_metrics(
    job_id: Annotated[str, typer.Argument(help="The job whose metrics to write.")],
    out: Annotated[
        Path, typer.Option(help="Directory for JOB.csv and JOB/ (TensorBoard event files).")
    ],
    format_: Annotated[
        str, typer.Option("--format", help="Comma-separated: csv, tensorboard.")
    ] = "csv,tensorboard",
    redis_url: RedisOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Write a job's metrics (one row per committed round or evaluation) to CSV and TensorBoard.

    The files replace this job's earlier ones in the directory; TensorBoard
    shows them with `tensorboard --logdir DIR`, one run per job.
    """
    from common.job import check_job_id  # it loads torch: not for `asteroid --help`
    from common.metrics_export import scalars
    from common.records.jobs import read_job
    from common.store import OUTAGE

    try:
        check_job_id(job_id, "the command line")
        formats = parse_formats(format_)
    except ConfigError as exc:
        raise fail(exc) from exc
    try:
        store = store_from(redis_url, cluster)
    except AsteroidError as exc:  # Redis not answering: UNREACHABLE
        raise fail(exc) from exc
    try:
        if read_job(store, job_id) is None:
            raise fail(
                ConfigError(f"job {job_id}: no such job in Redis at {store.where} ({store.prefix})")
            )
        records = read_records(store, job_id)
    except OUTAGE as exc:
        gone = StoreUnavailable(f"Redis at {store.where} went away: {exc}")
        raise fail(gone) from exc
    except ValueError as exc:  # JSON that no coordinator wrote
        raise fail(StoreError(f"metrics of job {job_id} in Redis: {exc}"), ExitCode.FAILED) from exc
    except StoreError as exc:  # a record of the wrong shape, named
        raise fail(exc, ExitCode.FAILED) from exc
    finally:
        store.close()
    try:
        wrote = _write(out, job_id, records, formats)
    except ImportError as exc:
        raise fail(
            ConfigError(f"TensorBoard's writer cannot be imported ({exc}): pip install tensorboard")
        ) from exc
    except OSError as exc:
        raise fail(ConfigError(f"cannot write to {out}: {exc}")) from exc
    points = sum(len(scalars(r)) for r in records)
    console.print(
        escape(
            f"wrote {len(records)} metrics records of job {job_id} ({points} scalars) to "
            + " and ".join(wrote)
        ),
        soft_wrap=True,
    )


def _write(out: Path, job_id: str, records: list[dict[str, Any]], formats: list[str]) -> list[str]:
    """Write the files `formats` name; where they went."""
    from common.metrics_files import CsvLog, EventLog, csv_path, events_dir

    wrote = []
    if "tensorboard" in formats:
        log = EventLog(events_dir(out, job_id), start=0, fresh=True)
        try:
            log.add(records)
        finally:
            log.close()
        wrote.append(f"{events_dir(out, job_id)}/")
    if "csv" in formats:
        CsvLog.create(csv_path(out, job_id), records)
        wrote.append(str(csv_path(out, job_id)))
    return wrote
