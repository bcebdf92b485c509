"""Fault injection: a worker that dies at an exact point of a round, as a power cut would.

Recovery can only be tested and measured if a failure can be placed exactly:
during a forward of a given micro-batch, in the all-reduce, after the optimizer
step, after the round was reported. The worker's `fail_at` setting names such
points (TorchFT's `fail_at` is the model); the stage runner and the worker call
`FailAt.check` there, and a match kills the process with SIGKILL, so that no
cleanup, goodbye or flush of sockets reaches the peers.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from common.logging import get_logger
from common.settings import WorkerSettings

__all__ = ["DONE_SETTLE_S", "FailAt"]

log = get_logger(__name__)

DONE_SETTLE_S = 0.2
"""How long `done` waits before the kill, so that the RoundDone handed to the control
link leaves the process: ZeroMQ sends from its own threads, which SIGKILL stops too."""


@dataclass(frozen=True)
class FailAt:
    """Points (round, phase, micro-batch or None: the first one run) at which to die.

    `allreduce` fires just before the group's all-reduce, also on a one-device
    stage where that is empty, so that a spec means the same moment on every stage.
    """

    points: frozenset[tuple[int, str, int | None]]

    @classmethod
    def parse(cls, text: str) -> FailAt | None:
        """The points of a `fail_at` spec ("1:forward:2,3:done"); None when it is empty.

        None lets the hooks cost one comparison when no fault is asked for.
        Raises ValueError naming the bad item.
        """
        points = WorkerSettings.parse_fail_at(text)
        return cls(frozenset(points)) if points else None

    def matches(self, round_no: int, phase: str, mb: int | None = None) -> bool:
        """Whether (round_no, phase, mb) is one of the points.

        A point without a micro-batch matches any, so it fires at the first
        one the device runs in that round.
        """
        return (round_no, phase, None) in self.points or (
            mb is not None and (round_no, phase, mb) in self.points
        )

    def check(self, round_no: int, phase: str, mb: int | None = None) -> None:
        """Kill this process now if (round_no, phase, mb) is one of the points."""
        if not self.matches(round_no, phase, mb):
            return
        if phase == "done":
            time.sleep(DONE_SETTLE_S)
        log.warning("fault injected", round=round_no, phase=phase, mb=mb)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
