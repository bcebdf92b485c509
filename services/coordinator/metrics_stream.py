"""A job's metrics streamed to files while it trains (the `metrics_dir` setting).

Part of the coordinator's shell: `JobRun` hands each metrics record over once
Redis has committed it, and this writes it to `DIR/JOB.csv` and the event
files in `DIR/JOB/`, flushed before the job goes on. Redis stays the record:
trouble with the files (a full disk, an unwritable directory, tensorboard not
installed) is logged and never reaches the job, and the next record writes the
files in step with Redis again (`common.metrics_files.resume`), as a restarted
coordinator does for the rounds its predecessor committed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from common.extras import MissingExtraError
from common.logging import get_logger
from common.metrics_files import CsvLog, EventLog, resume
from common.secrets import mask_text

__all__ = ["MetricsStream"]

log = get_logger(__name__)


class MetricsStream:
    """Files of one job's metrics, kept in step with its `metrics` stream in Redis."""

    def __init__(
        self, root: Path, job_id: str, history: Callable[[], list[dict[str, Any]]]
    ) -> None:
        """Stream job `job_id` under `root`; `history()` reads every record Redis holds for it."""
        self.root, self.job_id, self.history = root, job_id, history
        self.table: CsvLog | None = None
        """The open CSV table; None until the files are known to be in step with Redis."""
        self.events: EventLog | None = None
        self.tensorboard = True
        """False once importing TensorBoard's writer failed: CSV only from then on."""
        self.failing = False
        """Whether the last write failed (logged once, until writing works again)."""

    def record(self, entry: Mapping[str, Any]) -> None:
        """Write `entry`, which Redis just committed; trouble is logged, never raised.

        Catching every error is deliberate: the files are a copy for people to
        look at, and no fault in writing them may end a job whose state Redis
        holds safely (`asteroid export-metrics` writes them again from there).
        """
        try:
            if self.table is None:
                self._catch_up()  # Redis's records include `entry`
            else:
                if self.events is not None:
                    self.events.add([entry])
                self.table.append([entry])
        except Exception as exc:
            self._drop(exc)
            return
        if self.failing:
            self.failing = False
            log.info("metrics files written again", directory=str(self.root))

    def _catch_up(self) -> None:
        records = self.history()
        try:
            self.table, self.events = resume(self.root, self.job_id, records, self.tensorboard)
        except MissingExtraError as exc:
            self.tensorboard = False
            log.warning("streaming metrics to CSV only", error=str(exc))
            self.table, self.events = resume(self.root, self.job_id, records, events=False)

    def _drop(self, exc: Exception) -> None:
        """Let go of the files after `exc`; the next record writes them in step with Redis."""
        self.close()
        if not self.failing:
            self.failing = True
            log.warning(
                "cannot write the metrics files; the job goes on, its metrics stay in Redis",
                directory=str(self.root),
                error=mask_text(f"{type(exc).__name__}: {exc}"),
            )

    def close(self) -> None:
        """Flush and close the event file (at the job's end, or after an error)."""
        events, self.events, self.table = self.events, None, None
        if events is None:
            return
        try:
            events.close()
        except Exception as exc:  # same reason as in `record`
            log.warning("cannot close the metrics event file", error=mask_text(str(exc)))
