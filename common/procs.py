"""Child processes that cannot outlive whoever started them.

Each child gets its own session (a Ctrl-C on the terminal reaches only the
parent, which then stops children in order) and, on Linux, a parent-death
signal: if the parent is killed outright, the kernel sends the child
SIGTERM, so no service is left behind either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

__all__ = ["spawn", "stop_all"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    cmd: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session, tied to this process's life, output to `log`."""
    out: IO[bytes] | int = subprocess.DEVNULL
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = log.open("ab")
    try:
        return subprocess.Popen(
            list(cmd),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # spawned before any helper thread starts
        )
    finally:
        if not isinstance(out, int):
            out.close()


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 8.0) -> None:
    """SIGTERM every live process, wait up to `timeout_s` in all, then SIGKILL the rest.

    Signals go to each child's process group, so anything a child started
    itself goes too.
    """
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
