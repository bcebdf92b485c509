"""Resident memory, open files and threads of every cluster process, sampled on a thread.

Read from /proc (VmRSS and Threads in /proc/PID/status, the entries of
/proc/PID/fd): no psutil, and the same on loopback and on the testbed, whose
processes all live on this host. A process that exits between listing and
reading is skipped for that sample.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    """One process at one moment (`t`: wall clock, seconds)."""

    t: float
    name: str
    pid: int
    rss_kib: int
    fds: int
    threads: int


def read_process(name: str, pid: int, now: float | None = None) -> Sample | None:
    """A sample of process `pid`, or None once it is gone (or a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None
    rss = int(fields.get("VmRSS", "0 kB").split()[0])
    threads = int(fields.get("Threads", "0").strip())
    return Sample(time.time() if now is None else now, name, pid, rss, fds, threads)


class Sampler:
    """Samples every process `pids()` names every `period_s` until stopped."""

    def __init__(self, pids: Callable[[], dict[str, int]], period_s: float = 1.0) -> None:
        self._pids = pids
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)
        self.samples: list[Sample] = []
        self.loads: list[tuple[float, float]] = []
        """The machine's 1-minute load average over time: other work shares the machine."""
        self.errors: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Sample]:
        """Stop (bounded by a few periods) and return every sample taken."""
        self._stop.set()
        self._thread.join(timeout=max(5.0, 3 * self._period_s))
        return list(self.samples)

    def sample_once(self) -> None:
        now = time.time()
        self.loads.append((now, os.getloadavg()[0]))
        for name, pid in sorted(self._pids().items()):
            got = read_process(name, pid, now)
            if got is not None:
                self.samples.append(got)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # a sampler must never end the run; it says why it skipped
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self._period_s)
