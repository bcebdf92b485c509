"""The peers a user would pick instead of Asteroid: torch DDP over gloo and torch pipelining.

    python -m tests.bench.peers --mode ddp|pipe --rank R --world W --master ADDR:PORT \
        --model mobilenet_v2 [--options '{"width_mult": 0.5}'] --rounds N --global-batch B \
        [--micro-batch M] [--iface eth0] [--result FILE] [--save FILE]

Started once per device process (by `bench_edge` inside each device's
namespace and cgroup). Both peers train the zoo model on the synthetic data
our jobs use, with the same loss (the global batch's mean cross entropy) and
the same SGD, so their samples/s compare with the planners' on equal terms:

- ``ddp``: `DistributedDataParallel` over gloo; the global batch is split
  equally (shares differ by at most one sample) and every replica's loss is
  scaled so that the averaged gradient is the global batch's, whatever the
  split.
- ``pipe``: `torch.distributed.pipelining` with `Schedule1F1B`, the model's
  layers split evenly across ranks (a `PipelineStage` per rank over manually
  split submodules). 1F1B needs at least as many micro-batches as stages, so
  the micro-batch count is the smallest divisor of the global batch that is
  at least both the job's count and the number of stages.

A round is timed between barriers; the JSON result (printed as the last line
and written to ``--result``) holds each round's seconds and loss and the
samples/s over the median round after the first two, as the bench measures
Asteroid's jobs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from common.data import Dataset, dataset_for, split_indices
from common.zoo import ModelSpec, ZooModel, build_model

__all__ = [
    "PeerConfig",
    "PeerResult",
    "equal_shares",
    "even_split",
    "main",
    "pipe_microbatches",
    "run_peer",
]

T = TypeVar("T")

WARMUP_ROUNDS = 2
"""Rounds left out of the samples/s, as the bench leaves out Asteroid's first two."""


@dataclass(frozen=True)
class PeerConfig:
    """One peer process's part in a run."""

    mode: str
    rank: int
    world: int
    master: str
    model: ModelSpec
    rounds: int
    global_batch: int
    micro_batch: int
    lr: float = 0.01
    seed: int = 1
    threads: int = 1
    timeout_s: float = 600.0


@dataclass
class PeerResult:
    """What one rank measured: per-round seconds and (where the rank sees it) loss."""

    mode: str
    rank: int
    world: int
    microbatches: int
    global_batch: int
    round_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        """Global batch over the median round after the warm-up rounds."""
        return self.global_batch / statistics.median(self.timed_rounds())

    def timed_rounds(self) -> list[float]:
        """The rounds that count: all but the warm-up ones, if any remain."""
        rest = self.round_s[WARMUP_ROUNDS:]
        return rest or self.round_s

    def to_json(self) -> dict[str, Any]:
        """The result with samples/s, as the bench reads it."""
        return {**asdict(self), "samples_per_s": self.samples_per_s}


def equal_shares(total: int, parts: int) -> list[int]:
    """Split `total` samples into `parts` shares that differ by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def even_split(layers: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges of `parts` stages whose sizes differ by at most one.

    Raises:
        ValueError: Fewer layers than stages.

    """
    if layers < parts:
        raise ValueError(f"cannot split {layers} layers into {parts} non-empty stages")
    bounds = [0]
    for size in equal_shares(layers, parts):
        bounds.append(bounds[-1] + size)
    return list(itertools.pairwise(bounds))


def pipe_microbatches(global_batch: int, micro_batch: int, stages: int) -> int:
    """Micro-batches per round for 1F1B: our job's count, raised to at least one per stage.

    Only counts that divide the global batch are taken, so micro-batches are equal.

    Raises:
        ValueError: No divisor of the global batch reaches the number of stages.

    """
    want = max(global_batch // micro_batch, stages)
    for m in range(want, global_batch + 1):
        if global_batch % m == 0:
            return m
    raise ValueError(f"a global batch of {global_batch} cannot feed {stages} pipeline stages")


def _batch(data: Dataset, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training positions ``start .. start+count-1``, as a job with unbounded data sees them."""
    return data.batch(split_indices("train", start, count))


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds `fn` takes, from a barrier to a barrier, so every rank times the same round."""
    dist.barrier()
    t0 = time.perf_counter()
    value = fn()
    dist.barrier()
    return time.perf_counter() - t0, value


def _ddp_step(
    ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, scale: float
) -> torch.Tensor:
    """One replica's step; its loss, the share's part of the global mean times the world."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(ddp(x), y, reduction="sum") * scale
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return loss.detach()


def _pipe_step(
    schedule: Schedule1F1B,
    opt: torch.optim.Optimizer,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
) -> list[torch.Tensor]:
    """One 1F1B round of this stage; the micro-batch losses (last stage only)."""
    opt.zero_grad()
    losses: list[torch.Tensor] = []
    args = (x,) if x is not None else ()
    schedule.step(*args, target=y, losses=losses if y is not None else None)
    opt.step()
    return losses


def _train_ddp(cfg: PeerConfig, zoo: ZooModel, result: PeerResult) -> nn.Module:
    """Data parallel rounds: this rank's equal share, gradients all-reduced by DDP."""
    model = zoo.full()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
    data = dataset_for(zoo, cfg.seed)
    shares = equal_shares(cfg.global_batch, cfg.world)
    offset = sum(shares[: cfg.rank])
    # DDP averages over ranks: scaling by world makes the average the global sum / batch.
    scale = cfg.world / cfg.global_batch
    for r in range(cfg.rounds):
        x, y = _batch(data, r * cfg.global_batch + offset, shares[cfg.rank])
        seconds, loss = _timed(functools.partial(_ddp_step, ddp, opt, x, y, scale))
        result.round_s.append(seconds)
        total = loss / cfg.world
        dist.all_reduce(total)
        result.loss.append(float(total))
    return model


def _train_pipe(cfg: PeerConfig, zoo: ZooModel, result: PeerResult) -> nn.Module:
    """1F1B pipeline rounds over this rank's even share of the layers."""
    lo, hi = even_split(len(zoo.layers), cfg.world)[cfg.rank]
    module = zoo.stage(lo, hi)
    stage = PipelineStage(module, cfg.rank, cfg.world, torch.device("cpu"))
    # Mean over each micro-batch; the schedule divides gradients by their count.
    schedule = Schedule1F1B(stage, result.microbatches, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
    data = dataset_for(zoo, cfg.seed)
    first, last = cfg.rank == 0, cfg.rank == cfg.world - 1
    for r in range(cfg.rounds):
        idx = split_indices("train", r * cfg.global_batch, cfg.global_batch)
        x = data.batch(idx)[0] if first else None
        y = data.labels(idx) if last else None
        seconds, losses = _timed(functools.partial(_pipe_step, schedule, opt, x, y))
        result.round_s.append(seconds)
        if last:
            result.loss.append(float(torch.stack(losses).detach().mean()))
    return module


def run_peer(cfg: PeerConfig, save: Path | None = None) -> PeerResult:
    """Join the group, train `cfg.rounds` rounds, leave; optionally save the local weights.

    Raises:
        ValueError: Unknown mode, or a model or batch the pipeline cannot split.

    """
    if cfg.mode not in ("ddp", "pipe"):
        raise ValueError(f"mode must be 'ddp' or 'pipe', got {cfg.mode!r}")
    torch.set_num_threads(cfg.threads)
    zoo = build_model(cfg.model, cfg.seed)
    m = 1
    if cfg.mode == "pipe":
        m = pipe_microbatches(cfg.global_batch, cfg.micro_batch, cfg.world)
    result = PeerResult(cfg.mode, cfg.rank, cfg.world, m, cfg.global_batch)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{cfg.master}",
        rank=cfg.rank,
        world_size=cfg.world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        train = _train_ddp if cfg.mode == "ddp" else _train_pipe
        module = train(cfg, zoo, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if save is not None:
        torch.save(module.state_dict(), save)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "pipe"), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="ADDR:PORT of rank 0's rendezvous")
    p.add_argument("--model", required=True, help="zoo model name")
    p.add_argument("--options", default="{}", help="model options as a JSON object")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=None, help="default: the global batch")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--iface",
        default=None,
        help="network interface gloo binds (a device's host name may not resolve)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    p.add_argument("--result", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--save", type=Path, default=None, help="save this rank's weights here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one rank from the command line; the JSON result is the last line printed."""
    args = _parser().parse_args(argv)
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    cfg = PeerConfig(
        mode=args.mode,
        rank=args.rank,
        world=args.world,
        master=args.master,
        model=ModelSpec(name=args.model, options=json.loads(args.options)),
        rounds=args.rounds,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch or args.global_batch,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        timeout_s=args.timeout,
    )
    text = json.dumps(run_peer(cfg, args.save).to_json())
    if args.result is not None:
        args.result.write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
