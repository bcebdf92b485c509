"""Metrics files where people look: `DIR/JOB.csv` and TensorBoard event files in `DIR/JOB/`.

`asteroid export-metrics` writes both at once from Redis; the coordinator
grows them a committed round at a time (`metrics_dir`). Both lay them out the
same way through `common.metrics_export`, so the files do not depend on which
wrote them. TensorBoard's writer comes from `torch.utils.tensorboard`,
imported only when event files are written, so a command that never writes
one never loads torch.
"""

from __future__ import annotations

import csv
import io
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.extras import require
from common.metrics_export import columns, resume_point, row, scalars

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["EVENTS_GLOB", "CsvLog", "EventLog", "csv_path", "events_dir", "resume"]

EVENTS_GLOB = "events.out.tfevents.*"
"""TensorBoard's event file names; the only files a writer here ever deletes."""
_STAMP = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def _after_the_newest(directory: Path) -> None:
    """Wait (a second at most) until a new event file's name sorts after those in `directory`.

    TensorBoard reads a run's files in name order, and a name starts with its
    creation time in whole seconds; two files of one second may sort either way
    (the rest is host, pid and a counter), and the restart mark must come after
    the points it hides.
    """
    stamps = [int(m[1]) for p in directory.glob(EVENTS_GLOB) if (m := _STAMP.match(p.name))]
    wait = max(stamps, default=-1) + 1 - time.time()
    if 0 < wait <= 1:
        time.sleep(wait)


def csv_path(root: Path, job_id: str) -> Path:
    """Where the CSV table of job `job_id` goes under `root`."""
    return root / f"{job_id}.csv"


def events_dir(root: Path, job_id: str) -> Path:
    """Where the TensorBoard event files of job `job_id` go under `root` (one run per job)."""
    return root / job_id


class CsvLog:
    """A CSV table of metrics records that grows a row at a time.

    The header is `columns` of every field seen. A record with a field the
    header lacks rewrites the file with the wider header (atomically: a reader
    sees the old file or the new one); otherwise its row is appended. The rows
    stay in memory for that rewrite: a job keeps at most the metrics stream's
    cap of records.
    """

    def __init__(
        self, path: Path, header: list[str], rows: list[dict[str, str]], whole: bool = True
    ) -> None:
        self.path = path
        self.header = header
        self.rows = rows
        self.whole = whole
        """False when the file ends in a line cut short: the next append rewrites it."""

    @classmethod
    def load(cls, path: Path) -> CsvLog:
        """The table already at `path` (none there: an empty one, nothing written yet)."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls(path, [], [])
        reader = csv.DictReader(io.StringIO(text, newline=""))
        # a short row's missing cells read as None, a long row's extras under None
        rows = [{k: v for k, v in r.items() if isinstance(k, str) and v} for r in reader]
        whole = not text or text.endswith("\n")
        if not whole and rows:  # the writer died mid-row: that row is not written
            rows.pop()
        return cls(path, list(reader.fieldnames or []), rows, whole)

    @classmethod
    def create(cls, path: Path, records: Iterable[Mapping[str, Any]]) -> CsvLog:
        """Write `records` to `path` afresh, replacing what was there."""
        rows = [row(r) for r in records]
        log = cls(path, columns(name for r in rows for name in r), rows)
        log._rewrite()
        return log

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Add one row per record, flushed to the OS before this returns."""
        new = [row(r) for r in records]
        if not new:
            return
        self.rows += new
        seen = {name for r in new for name in r}
        if not self.whole or not self.header or not seen <= set(self.header):
            self.header = columns([*self.header, *seen])
            self._rewrite()
            return
        with self.path.open("a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, self.header, restval="").writerows(new)

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, self.header, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
        self.whole = True


class EventLog:
    """One TensorBoard event file in a job's run directory, written a record at a time.

    Values are TensorBoard's classic scalars, float32: the only scalar form
    that every TensorBoard loader reads (its default, Rust one skips float64
    tensors). The CSV table keeps the exact values.
    """

    def __init__(self, directory: Path, start: int, fresh: bool = False) -> None:
        """Open a new event file in `directory`; with `fresh`, delete its earlier ones first.

        A restarted writer adds a file next to the earlier ones (TensorBoard
        reads them all, in name order, which is time order). Every file starts
        with TensorBoard's restart mark at step `start`: the points of earlier
        files at that step or later are hidden, so the ones written again here
        replace them (a step beyond all written hides nothing). `fresh` is for
        a run written again from scratch.
        """
        require("tensorboard", "writing TensorBoard event files")
        from torch.utils.tensorboard import SummaryWriter  # torch only where events are written

        directory.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in directory.glob(EVENTS_GLOB):
                old.unlink()
        _after_the_newest(directory)
        self.directory = directory
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(directory), purge_step=start)

    def add(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Write every numeric field of `records` at their rounds, then flush to the file."""
        writer = self._writer
        if writer is None:
            raise ValueError(f"the event file in {self.directory} is closed")
        for record in records:
            for s in scalars(record):
                writer.add_scalar(s.tag, s.value, s.step, s.wall_time)
        writer.flush()

    def close(self) -> None:
        """Flush and close the file (again: nothing)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


def _step(record: Mapping[str, Any]) -> int | None:
    step = record.get("round")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def resume(
    root: Path, job_id: str, records: Sequence[Mapping[str, Any]], events: bool = True
) -> tuple[CsvLog, EventLog | None]:
    """Bring `root`'s files of job `job_id` up to `records` (every record so far), then open.

    Files that hold the first records already get the rest appended (a
    restarted coordinator goes on without writing a round twice); files that
    disagree with the records are written again from them. The CSV table is
    the mark of what was written. The event file is written first for each
    record, so it may hold part of the first record the table lacks (the
    writer died, or failed, between the two): the new event file purges from
    that record's round on (TensorBoard's restart mark) and writes every
    record from that round on again, so each point shows exactly once.
    """
    table = CsvLog.load(csv_path(root, job_id))
    done = resume_point(table.rows, records)
    fresh = not done  # nothing in the table (or the wrong things): nothing belongs in events
    todo = records if done is None else records[done:]
    steps = [step for r in records if (step := _step(r)) is not None]
    start = 0 if fresh else max(steps, default=0) + 1  # hides nothing...
    again = list(todo)
    if not fresh and todo and (doubt := _step(todo[0])) is not None:
        start = doubt  # ...unless a record's points may precede its row: that round again
        again = [r for r in records[:done] if (step := _step(r)) is not None and step >= doubt]
        again += todo
    log = EventLog(events_dir(root, job_id), start, fresh) if events else None
    try:
        if log is not None:
            log.add(again)
        if done is None:
            table = CsvLog.create(csv_path(root, job_id), records)
        else:
            table.append(todo)
    except BaseException:
        if log is not None:
            log.close()
        raise
    return table, log
