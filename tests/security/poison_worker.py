"""A plan member that poisons what it sends: a real worker with a valid place in the plan.

`python -m tests.security.poison_worker --poison NAME --from-round R WORKER-FLAGS...`
runs `asteroid-worker` with a dispatcher that, from round R on, rewrites the
tensors of one kind of data-plane message before they leave: nan activations,
inf gradients, nan all-reduce chunks, or labels of 10**6. Everything else about
the worker is honest, so its parts come from the very device the plan names
(the transport's checks pass) and only their values are wrong.
"""

from __future__ import annotations

import argparse
import enum
import sys
from typing import Any

import torch

import services.worker.main as worker_main
from common.messages import Activation, Gradient, Message, ReduceChunk
from services.worker.transport import Dispatcher

HUGE_LABEL = 10**6


class Poison(enum.Enum):
    """What the worker spoils in what it sends."""

    NAN_ACTIVATIONS = "nan-activations"
    """One value of each activation tensor it sends is nan."""
    INF_GRADIENTS = "inf-gradients"
    """One value of each gradient tensor it sends back is inf."""
    NAN_CHUNKS = "nan-chunks"
    """One value of each all-reduce chunk it sends is nan."""
    HUGE_LABELS = "huge-labels"
    """Every label its activations carry is `HUGE_LABEL`."""


def _spoiled(t: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of `t` with its first value set to `value` (a sent tensor is never written)."""
    out = t.clone()
    out.view(-1)[0] = value
    return out


def poisoned(poison: Poison, msg: Message, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors `msg` leaves with under `poison` (unchanged for the other kinds)."""
    if isinstance(msg, Activation) and poison is Poison.NAN_ACTIVATIONS:
        return [_spoiled(tensors[0], float("nan")), *tensors[1:]]
    if isinstance(msg, Activation) and poison is Poison.HUGE_LABELS:
        return [tensors[0], torch.full_like(tensors[1], HUGE_LABEL)]
    if isinstance(msg, Gradient) and poison is Poison.INF_GRADIENTS:
        return [_spoiled(tensors[0], float("inf"))]
    if isinstance(msg, ReduceChunk) and poison is Poison.NAN_CHUNKS:
        return [_spoiled(tensors[0], float("nan"))]
    return tensors


def _dispatcher_class(poison: Poison, from_round: int) -> type[Dispatcher]:
    class PoisonDispatcher(Dispatcher):
        def send(
            self, dst: str, msg: Message, tensors: list[torch.Tensor] | tuple[()] = ()
        ) -> None:
            if isinstance(msg, Activation | Gradient | ReduceChunk) and msg.round >= from_round:
                tensors = poisoned(poison, msg, list(tensors))
            super().send(dst, msg, tensors)

    return PoisonDispatcher


def main(argv: list[str] | None = None) -> None:
    """Parse the poison flags, patch the worker's dispatcher, run the worker with the rest."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--poison", required=True, choices=[p.value for p in Poison])
    parser.add_argument("--from-round", type=int, default=0)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    cls: Any = _dispatcher_class(Poison(args.poison), args.from_round)
    worker_main.Dispatcher = cls
    worker_main.main(rest)


if __name__ == "__main__":
    main()
