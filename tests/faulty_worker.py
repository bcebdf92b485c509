"""A real worker process with one deliberate fault, for mutation and failure tests.

`python -m tests.faulty_worker --fault NAME [--fault-stage P] [--fault-round R]
WORKER-FLAGS...` runs `asteroid-worker` with its stage runner or dispatcher
replaced by a subclass that injects the fault. A test that must catch a bug runs
the same job with such a worker and asserts that it does.
"""

from __future__ import annotations

import argparse
import enum
import sys
from typing import Any

import torch

import services.worker.main as worker_main
from common.messages import Message
from services.worker.stage import StageRunner
from services.worker.transport import Dispatcher


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


def _runner_class(fault: Fault, stage: int) -> type[StageRunner]:
    class FaultyRunner(StageRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if fault is Fault.NO_WEIGHT_DECAY and self.p == stage:
                for group in self.optimizer.param_groups:
                    group["weight_decay"] = 0.0

        def _backward(self, round_no: int, mb: int, x: torch.Tensor, out: torch.Tensor) -> None:
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
    else:
        worker_main.StageRunner = _runner_class(fault, args.fault_stage)  # type: ignore[misc]
    worker_main.main(rest)


if __name__ == "__main__":
    main()
