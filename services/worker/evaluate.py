"""Held-out evaluation through the pipeline: forward only, nothing updated.

Evaluation reuses the training routes, so every sample is evaluated on the
devices that would train it and no stage needs the whole model. Activations
travel as phase "eval" with their labels, keyed by the round of the weights
they evaluate; the pool keeps them apart from training parts. No gradient,
no all-reduce, no optimizer step, and modules run in eval mode, so weights
and batch-norm statistics stay exactly as they were.

Held-out positions past the data's `eval_size` (the last batch may run over)
are still computed, because the pipeline's batch geometry is fixed, but their
labels are replaced by `PAST_END`, which the loss ignores and no prediction
matches, so every held-out sample counts exactly once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.errors import AsteroidError
from common.messages import Activation
from common.schedule import Action, PoolView, next_eval
from services.worker.numerics import PAST_END, require_finite
from services.worker.transfers import to_device, to_host

if TYPE_CHECKING:
    from services.worker.stage import StageRunner

__all__ = ["PAST_END", "EvalResult", "evaluate"]


@dataclass
class EvalResult:
    """What a worker reports for one evaluation.

    `samples` counts the held-out samples that passed through this device;
    on the last stage `loss_sum` is their summed cross-entropy and `correct`
    their correct predictions (other stages report zeros).
    """

    samples: int = 0
    loss_sum: float = 0.0
    correct: int = 0


def evaluate(runner: StageRunner, round_no: int, batches: int) -> EvalResult:
    """Run this device's share of `batches` held-out global batches through its stage.

    Raises:
        AsteroidError: The runner does not hold the weights of round `round_no`,
            or a peer did not deliver within the task timeout (or the wait was aborted).

    """
    if round_no != runner.round:
        raise AsteroidError(
            f"asked to evaluate the weights of round {round_no}, this worker holds those of "
            f"round {runner.round} (RunEval.round counts the rounds applied, like checkpoints)"
        )
    n = batches * runner.m
    runner.pool.begin_eval(round_no)
    res = EvalResult()
    runner.module.eval()
    try:
        with torch.no_grad():
            for j in range(n):
                with runner.blocked():  # waiting on a peer is not being hung
                    runner.pool.wait(
                        functools.partial(_decide, runner, round_no, j, n),
                        runner.timeout,
                        functools.partial(_waiting_for, runner, j),
                        functools.partial(runner.pool.missing, round_no, "E", j),
                        ("eval", round_no),
                    )
                _forward(runner, round_no, j, res)
    finally:
        runner.module.train()
    return res


def _decide(runner: StageRunner, round_no: int, j: int, n: int) -> Action | None:
    """Ask the pure scheduler whether evaluation micro-batch `j` can run (under the lock)."""
    ready = frozenset((j,)) if runner.first else runner.pool.ready(round_no, "E")
    view = PoolView(next_forward=j, alive=0, forward_ready=ready, backward_ready=frozenset())
    return next_eval(view, runner.p, n)


def _waiting_for(runner: StageRunner, j: int) -> str:
    return (
        f"evaluation activations of micro-batch {j} (batch {j // runner.m}) "
        f"from stage {runner.p - 1}"
    )


def _inputs(runner: StageRunner, round_no: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out samples of evaluation micro-batch `j` in this device's range."""
    lo, hi = runner.span
    if runner.data is None:
        x, y = runner.pool.take(round_no, "E", j)
        return x, y
    batch, mb = divmod(j, runner.m)
    start = batch * runner.plan.global_batch + mb * runner.plan.micro_size + lo
    x, y = runner.data.eval_batch(start, hi - lo)
    positions = torch.arange(start, start + hi - lo)
    return x, y.masked_fill(positions >= runner.data.eval_size, PAST_END)


def _forward(runner: StageRunner, round_no: int, j: int, res: EvalResult) -> None:
    x, y = _inputs(runner, round_no, j)
    res.samples += int((y != PAST_END).sum())
    out = runner.module(to_device(x, runner.compute))
    if runner.last:
        y = to_device(y, runner.compute)
        loss = nn.functional.cross_entropy(out, y, reduction="sum", ignore_index=PAST_END)
        res.loss_sum += float(loss)
        res.correct += int((out.argmax(dim=1) == y).sum())
        return
    require_finite(
        [("", out)], f"the evaluation activations of micro-batch {j} in round {round_no}"
    )
    lo = runner.span[0]
    out = to_host(out)
    for r in runner.fwd_routes:
        msg = Activation(
            epoch=runner.epoch,
            round=round_no,
            mb=j,
            stage=runner.p + 1,
            lo=r.lo,
            hi=r.hi,
            phase="eval",
        )
        runner.out.send(r.dst, msg, [out[r.lo - lo : r.hi - lo], y[r.lo - lo : r.hi - lo]])
