"""A real worker process with one deliberate fault, for mutation and failure tests.

`python -m tests.faulty_worker --fault NAME [--fault-stage P] [--fault-round R]
WORKER-FLAGS...` runs `asteroid-worker` with its stage runner or dispatcher
replaced by a subclass that injects the fault. A test that must catch a bug runs
the same job with such a worker and asserts that it does.
"""

from __future__ import annotations

import argparse
import enum
import os
import queue
import signal
import sys
import time
from typing import Any, NamedTuple

import torch

import services.worker.main as worker_main
from common.codec import encode
from common.logging import get_logger
from common.messages import Activation, Gradient, Message, ReduceChunk
from services.worker.stage import RoundResult, StageRunner
from services.worker.transport import Dispatcher

log = get_logger(__name__)

STALL_S = 3600.0
"""How long a stall lasts unless preempted: longer than any test."""


class Fault(enum.Enum):
    """What the faulty worker gets wrong."""

    NO_WEIGHT_DECAY = "no-weight-decay"
    """Its stage's optimizer ignores the job's weight decay."""
    SKIP_GRADIENT = "skip-gradient"
    """The last micro-batch of each round adds nothing to its stage's gradients
    (the gradient to the previous stage is still sent, so nothing blocks)."""
    CUT_DATA = "cut-data"
    """From round `--fault-round` on, nothing it sends on the data plane arrives;
    the control plane (heartbeats, replies) stays up."""
    FAIL_ROUND = "fail-round"
    """Its stage raises a RuntimeError at the start of round `--fault-round`
    (the worker reports it as a WorkerError and keeps serving)."""
    SLOW_DATA = "slow-data"
    """From round `--fault-round` on, every activation, gradient and all-reduce chunk it
    sends leaves `SLOW_S` late, as over a slow link: its compute and link probes are untouched."""
    SLOW_ROUNDS = "slow-rounds"
    """From its `--fault-round`-th assignment (epoch) on, each of its rounds takes
    `SLOW_ROUND_S` longer, as on a device throttled mid-run (a federated home's
    local jobs are one assignment each, so this slows the home from that piece on)."""
    DIE_SENDING = "die-sending"
    """The first time an assignment asks it to send layers to a peer (a migration in a
    recovery or a re-plan), it is SIGKILLed before it sends any: a source that dies while
    the recovery it serves is under way, its receivers waiting for its layers."""
    SLOW_COMPUTE = "slow-compute"
    """From round `--fault-round` on, each of its backwards takes `SLOW_COMPUTE_S` longer,
    inside the backward's own timing: a device whose compute slowed down (the measured
    speeds, not the waits, see it), on whatever stage it is assigned."""
    STALL_ALLREDUCE = "stall-allreduce"
    """In round `--fault-round`, its stage stops before its all-reduce (logging
    `STALL_EVENT`) until a new assignment or a shutdown, so that a test can kill
    it while its group's peers wait in the all-reduce."""


STALL_EVENT = "fault: stalling before the all-reduce"
DIE_EVENT = "fault: dying instead of sending layers"
SLOW_S = 0.1
SLOW_ROUND_S = 0.5
"""How much longer a slow-rounds worker's rounds take."""
"""How late a slow-data worker's data-plane messages leave."""
SLOW_COMPUTE_S = 0.05
"""How much longer a slow-compute worker's backwards take."""


def _runner_class(fault: Fault, stage: int, fault_round: int) -> type[StageRunner]:
    class FaultyRunner(StageRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if fault is Fault.NO_WEIGHT_DECAY and self.p == stage:
                for group in self.optimizer.param_groups:
                    group["weight_decay"] = 0.0

        def run_round(self, round_no: int, *rest: Any) -> RoundResult:
            if fault is Fault.FAIL_ROUND and self.p == stage and round_no == fault_round:
                raise RuntimeError(f"injected fault in round {round_no} on stage {self.p}")
            if fault is Fault.SLOW_ROUNDS and self.epoch >= fault_round:
                time.sleep(SLOW_ROUND_S)
            return super().run_round(round_no, *rest)

        def _allreduce(self, round_no: int) -> None:
            if fault is Fault.STALL_ALLREDUCE and self.p == stage and round_no == fault_round:
                log.warning(STALL_EVENT, round=round_no)
                # a wait that nothing completes: only a preemption (or a kill) ends it
                self.pool.wait(lambda: None, STALL_S, lambda: "a stall to end")
            super()._allreduce(round_no)

        def _backward(self, round_no: int, mb: int, x: torch.Tensor, out: torch.Tensor) -> None:
            if fault is Fault.SLOW_COMPUTE and round_no >= fault_round:
                time.sleep(SLOW_COMPUTE_S)
            if fault is not Fault.SKIP_GRADIENT or self.p != stage or mb != self.m - 1:
                super()._backward(round_no, mb, x, out)
                return
            params = list(self.module.parameters())
            saved = [None if p.grad is None else p.grad.clone() for p in params]
            super()._backward(round_no, mb, x, out)
            for p, g in zip(params, saved, strict=True):
                p.grad = g

    return FaultyRunner


def _dispatcher_class(cut_round: int) -> type[Dispatcher]:
    class CutDispatcher(Dispatcher):
        def send(
            self, dst: str, msg: Message, tensors: list[torch.Tensor] | tuple[()] = ()
        ) -> None:
            if getattr(msg, "round", -1) >= cut_round:
                return
            super().send(dst, msg, tensors)

    return CutDispatcher


class _Late(NamedTuple):
    """A queued send to make `SLOW_S` late."""

    item: tuple[str, list[Any]]


class _LateQueue(queue.Queue[Any]):
    """The dispatcher's queue: a `_Late` item leaves `SLOW_S` after the sending thread takes it."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        if isinstance(item, _Late):
            time.sleep(SLOW_S)
            return item.item
        return item


def _slow_dispatcher_class(from_round: int) -> type[Dispatcher]:
    class SlowDispatcher(Dispatcher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.q = _LateQueue()

        def send(
            self, dst: str, msg: Message, tensors: list[torch.Tensor] | tuple[()] = ()
        ) -> None:
            if isinstance(msg, Activation | Gradient | ReduceChunk) and msg.round >= from_round:
                self.q.put(_Late((dst, encode(msg, self.device, tensors))))
                return
            super().send(dst, msg, tensors)

    return SlowDispatcher


def _dying_worker_class() -> type[worker_main.Worker]:
    class DyingWorker(worker_main.Worker):
        def _send_layers(self, epoch: int, version: int, sends: Any, kept: list[int]) -> Any:
            if any(sends.values()):
                log.warning(DIE_EVENT, epoch=epoch, sends={str(d): v for d, v in sends.items()})
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._send_layers(epoch, version, sends, kept)

    return DyingWorker


def main(argv: list[str] | None = None) -> None:
    """Parse the fault flags, patch the worker's classes, run the worker with the rest."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fault", required=True, choices=[f.value for f in Fault])
    parser.add_argument("--fault-stage", type=int, default=0)
    parser.add_argument("--fault-round", type=int, default=0)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    fault = Fault(args.fault)
    if fault is Fault.CUT_DATA:
        worker_main.Dispatcher = _dispatcher_class(args.fault_round)  # type: ignore[misc]
    elif fault is Fault.DIE_SENDING:
        worker_main.Worker = _dying_worker_class()  # type: ignore[misc]
    elif fault is Fault.SLOW_DATA:
        worker_main.Dispatcher = _slow_dispatcher_class(args.fault_round)  # type: ignore[misc]
    else:
        worker_main.StageRunner = _runner_class(fault, args.fault_stage, args.fault_round)  # type: ignore[misc]
    worker_main.main(rest)


if __name__ == "__main__":
    main()
