"""What a step's replies commit to the job's record: a round's metrics and ledger, an evaluation.

Pure bookkeeping for the driver (`driver.apply`): from the devices' replies to a
round or an evaluation, the job's updated summary and speeds, and the Publish
and Log commands that record them. Which step comes next stays the driver's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from common.async_versions import changes_per_window
from common.ids import DeviceId
from common.job_data import sample_indices
from common.ledger import round_entry
from common.messages import EvalDone, RoundDone
from services.coordinator import adapt, link_drift
from services.coordinator.core import Log
from services.coordinator.job_state import Out, Publish, Run

__all__ = ["evaluated", "round_committed", "weight_version"]


def round_committed(run: Run, done: Mapping[DeviceId, RoundDone], now: float) -> Out:
    """The round committed: its loss, metrics and sample ledger to publish, the summary, speeds."""
    r, plan, job = run.step, run.plan, run.job
    elapsed = max(now - run.step_t0, 1e-9)
    last = [a.device for a in plan.stages[-1].devices]
    loss = sum(done[d].loss_sum for d in last)
    acc = sum(done[d].correct for d in last) / plan.global_batch
    rate = plan.global_batch / elapsed
    lo, hi = r * plan.global_batch, (r + 1) * plan.global_batch
    samples = sample_indices(job.seed, run.train_size, lo, hi - lo)
    publish = Publish(
        f"committing round {r}",
        {"round": r + 1, "epoch": run.epoch, "loss": loss, "samples_per_s": rate},
        {
            "round": r,
            "epoch": run.epoch,
            "loss": loss,
            "accuracy": acc,
            "round_s": elapsed,
            "samples_per_s": rate,
            "devices": {
                d: {
                    "stage": m.stage,
                    "max_alive": m.max_alive,
                    "peak_bytes": m.peak_bytes,
                    "peak_saved_bytes": m.peak_saved_bytes,
                    **m.timings.model_dump(),
                }
                for d, m in done.items()
            },
        },
        round_entry(r, run.epoch, lo, hi, samples),
    )
    s = run.summary
    summary = replace(
        s,
        losses=(*s.losses, loss),
        accuracies=(*s.accuracies, acc),
        round_s=(*s.round_s, elapsed),
        max_alive={
            **s.max_alive,
            **{d: max(s.max_alive.get(d, 0), m.max_alive) for d, m in done.items()},
        },
        peak_bytes={
            **s.peak_bytes,
            **{d: max(s.peak_bytes.get(d, 0), m.peak_bytes) for d, m in done.items()},
        },
    )
    if run.costs is not None:
        run = replace(run, speeds=adapt.measure(run.speeds, plan, run.costs, done))
    if run.job.adapt and run.speeds.base is not None:  # compute has a baseline to drift from
        compute_s = (plan.predicted_round_s or 0.0) - plan.predicted_comm_s
        watch = link_drift.observe(run.watch, plan.predicted_comm_s, done, run.speeds, compute_s)
        run = replace(run, watch=watch)
    run = replace(run, committed=r + 1, summary=summary, wait=None)
    log = Log(
        "info",
        "round committed",
        {
            "round": r,
            "loss": round(loss, 5),
            "accuracy": round(acc, 3),
            "round_s": round(elapsed, 3),
        },
    )
    return run, [publish, log]


def evaluated(run: Run, done: Mapping[DeviceId, EvalDone]) -> Out:
    """The evaluation of `run.step` recorded: its loss and accuracy to publish and log."""
    round_no = run.step
    last = [a.device for a in run.plan.stages[-1].devices]
    samples = sum(done[d].samples for d in last)
    loss = sum(done[d].loss_sum for d in last) / max(1, samples)
    acc = sum(done[d].correct for d in last) / max(1, samples)
    summary = replace(run.summary, evals=(*run.summary.evals, (round_no, loss, acc)))
    publish = Publish(
        f"recording the evaluation of round {round_no}",
        {"eval_loss": loss, "eval_accuracy": acc},
        {"round": round_no - 1, "eval_loss": loss, "eval_accuracy": acc, "eval_samples": samples},
    )
    log = Log(
        "info",
        "evaluated",
        {"round": round_no, "eval_loss": round(loss, 4), "eval_accuracy": round(acc, 3)},
    )
    return replace(run, summary=summary, wait=None), [publish, log]


def weight_version(run: Run, round_no: int) -> int:
    """Weight changes after `round_no` rounds: one per round, or per window's mini-batches."""
    if run.job.mode == "sync":
        return round_no
    return round_no * changes_per_window(run.plan.microbatches, run.job.aggregate_every)
