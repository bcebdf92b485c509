"""What a job did, measured next to what the simulator predicted for its plan.

Everything comes from Redis: the plan and cluster the coordinator stored,
the profiles the planner used, and the per-device timings of every round.
The first rounds are left out of averages (start-up: allocator growth,
first-touch pages, lazy initialisation).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from common.errors import ConfigError
from common.plan import Plan
from common.profile import load_profiles
from common.records.documents import read_cluster, read_plan
from common.records.metrics import read_metrics
from common.store import Store
from services.planner.cost import CostModel
from services.planner.simulator import SimResult, simulate

__all__ = ["JobReport", "job_report", "stage_table", "summary_table"]

WARM_UP_ROUNDS = 2


@dataclass
class JobReport:
    """The plan, the simulation of it, and the measured rounds."""

    plan: Plan
    sim: SimResult | None
    cost: CostModel | None
    rounds: list[dict[str, Any]]
    evals: list[dict[str, Any]]

    @property
    def steady(self) -> list[dict[str, Any]]:
        """Rounds after the warm-up ones (all of them if the job was short)."""
        return self.rounds[WARM_UP_ROUNDS:] or self.rounds

    @property
    def measured_samples_per_s(self) -> float:
        """Global batch over the median steady round time."""
        return self.plan.global_batch / float(statistics.median(r["round_s"] for r in self.steady))


def job_report(store: Store, job_id: str) -> JobReport:
    """Assemble the report of `job_id` from Redis."""
    plan = read_plan(store, job_id)
    if plan is None:
        raise ConfigError(f"job {job_id} has no plan in Redis: it was never planned")
    metrics = [m.fields() for m in read_metrics(store, job_id)]
    cluster = read_cluster(store, job_id)
    sim, cost = None, None
    if cluster is not None:
        profiles = load_profiles(store, sorted({d.profile for d in cluster.devices}))
        cost = CostModel(profiles, cluster)
        sim = simulate(plan, cost)
    return JobReport(
        plan=plan,
        sim=sim,
        cost=cost,
        rounds=[m for m in metrics if "loss" in m],
        evals=[m for m in metrics if "eval_accuracy" in m],
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def stage_table(rep: JobReport) -> Table:
    """Per stage: devices, layers, and mean compute, waiting and all-reduce time per round."""
    table = Table(title="where each round's time went (mean per device, steady rounds)")
    for col in ("stage", "layers", "devices", "compute ms", "wait ms", "all-reduce ms"):
        table.add_column(col, justify="right")
    for p, stage in enumerate(rep.plan.stages):
        names = [a.device for a in stage.devices]
        per = [r["devices"][d] for r in rep.steady for d in names if d in r["devices"]]
        compute = _mean([t["forward_s"] + t["backward_s"] + t["step_s"] for t in per])
        table.add_row(
            str(p),
            f"[{stage.start}, {stage.end})",
            ", ".join(f"{a.device}:{a.share}" for a in stage.devices),
            f"{compute * 1000:.1f}",
            f"{_mean([t['wait_s'] for t in per]) * 1000:.1f}",
            f"{_mean([t['allreduce_s'] for t in per]) * 1000:.1f}",
        )
    return table


def summary_table(rep: JobReport, timeline: Path | None = None) -> Table:
    """Loss, held-out accuracy before and after, and measured against simulated speed."""
    table = Table(title=f"{rep.plan.planner} plan, {len(rep.rounds)} rounds")
    table.add_column("")
    table.add_column("value", justify="right")
    if rep.rounds:
        table.add_row(
            "loss, first → last round",
            f"{rep.rounds[0]['loss']:.3f} → {rep.rounds[-1]['loss']:.3f}",
        )
    if rep.evals:
        first, last = rep.evals[0], rep.evals[-1]
        table.add_row(
            f"held-out accuracy, round {first['round'] + 1} → {last['round'] + 1}",
            f"{first['eval_accuracy']:.1%} → {last['eval_accuracy']:.1%}",
        )
    if rep.rounds:
        measured = rep.measured_samples_per_s
        table.add_row("measured samples/s", f"{measured:.1f}")
        if rep.sim is not None:
            table.add_row("simulated samples/s", f"{rep.sim.throughput:.1f}")
            table.add_row("measured / simulated", f"{measured / rep.sim.throughput:.2f}")
    if timeline is not None:
        table.add_row("simulated timeline", str(timeline))
    return table
