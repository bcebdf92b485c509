"""bench_async's runs: a job through a runner, and what its metrics and events say.

A run's numbers come from the coordinator's own streams: samples/s from the
round metrics (the first round skipped: it warms up), each stage's forward,
backward and step seconds from the `devices` part of the same metrics (what
every RoundDone reports), accuracy from the evaluations, re-partitions from
the events. From the stage timings the simulator predicts each mode's window
(`services.planner.async_gain`), so a measured ratio has a prediction beside it
from the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.planner.async_gain import StageCost
from tests.bench.async_jobs import DATA, LR, MODEL, Config, job_for, plan_for, plan_of
from tests.bench.async_runners import Extras, Outcome
from tests.bench.recovery_jobs import stages_text


@dataclass
class Run:
    """One job: what ran and what its metrics say."""

    part: str
    config: str
    mode: str
    microbatches: int
    aggregate_every: int
    rep: int
    lr: float = LR
    samples_per_s: float | None = None
    rounds_s: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    stages: list[dict[str, float]] = field(default_factory=list)
    """Per stage, the median over the measured rounds of its forward, backward and step
    seconds per round (the first round skipped)."""
    replans: list[dict[str, Any]] = field(default_factory=list)
    """Re-partitions (`replanned` events): round, reason, stages after."""
    phases: dict[str, float | None] = field(default_factory=dict)
    """Part 2: samples/s before the throttle, after it and after the re-partition."""
    wall_s: float = 0.0
    note: str = ""

    @property
    def final(self) -> float | None:
        return self.accuracies[-1] if self.accuracies else None

    @property
    def best(self) -> float | None:
        return max(self.accuracies) if self.accuracies else None


class Runner(Protocol):
    """Runs one job on one plan to its end; (coordinator exit code, metrics, events).

    `extras` (part 2) are written before the run's coordinator starts; `outcome`
    says what the runner did on the way (the round it throttled at).
    """

    extras: Extras | None
    outcome: Outcome

    def __call__(
        self, label: str, job: dict[str, Any], plan: dict[str, Any]
    ) -> tuple[int | None, list[dict[str, Any]], list[dict[str, Any]]]: ...


THROUGHPUT_SETS = {
    "throughput": "fl_cnn, 8x8 digits (light layers)",
    "heavy": "fl_cnn, 3x32x32 synthetic images (heavy layers)",
    "balanced": "mobilenet_v2 x0.5, 3x32x32 synthetic images (stages balanced by cost)",
}
"""Part 1's sets of rows by their runs' `part`, at the same micro-batch and windows'
meaning: on one plan of one layer per stage, a model whose layers are light (their
update is not small against their compute) and one whose layers are heavy against their
parameters; then a deeper model cut so that the stages take about as long."""


# --- metrics -> numbers ----------------------------------------------------------


def _rounds(metrics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in metrics if "loss" in m and "round_s" in m]


def samples_per_s(
    metrics: Sequence[dict[str, Any]], global_batch: int
) -> tuple[float | None, list[float]]:
    """Global batch over the median round after the first, and every round's seconds."""
    rounds = [float(m["round_s"]) for m in _rounds(metrics)]
    steady = rounds[1:]
    if not steady:
        return None, rounds
    return global_batch / statistics.median(steady), rounds


def stage_timings(metrics: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage (by its number), the median forward_s, backward_s and step_s of a round.

    The rounds after the first, each stage's slowest device (a stage of one
    device: its own). For runs that keep their plan (parts 1 and 3).
    """
    rounds = _rounds(metrics)[1:]
    per: dict[int, dict[str, list[float]]] = {}
    for m in rounds:
        devices = m.get("devices") or {}
        by_stage: dict[int, dict[str, float]] = {}
        for d in devices.values():
            s = int(d.get("stage", -1))
            cur = by_stage.setdefault(s, {"forward_s": 0.0, "backward_s": 0.0, "step_s": 0.0})
            for k in cur:
                cur[k] = max(cur[k], float(d.get(k, 0.0)))
        for s, t in by_stage.items():
            lists = per.setdefault(s, {k: [] for k in t})
            for k, v in t.items():
                lists[k].append(v)
    return [{k: statistics.median(v) for k, v in per[s].items()} for s in sorted(per) if s >= 0]


def stage_costs(stages: Sequence[dict[str, float]], mode: str, m: int) -> list[StageCost]:
    """A run's stage timings as the predictor's costs per micro-batch.

    Sync steps once a round (`step_s`). Async updates after every backward:
    what its round reports as step time (or inside the backward, where the
    worker times the update with it) is M updates, so it is the update's cost.
    """
    out = []
    for t in stages:
        f, b, step = t["forward_s"] / m, t["backward_s"] / m, t["step_s"]
        if mode == "sync":
            out.append(StageCost(f, b, step_s=step))
        else:
            out.append(StageCost(f, b, update_s=step / m))
    return out


def accuracy_curve(metrics: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(seconds since the first evaluation, held-out accuracy) of every evaluation."""
    evals = [m for m in metrics if "eval_accuracy" in m and "time" in m]
    if not evals:
        return [], []
    t0 = float(evals[0]["time"])
    return [float(m["time"]) - t0 for m in evals], [float(m["eval_accuracy"]) for m in evals]


def time_to(times: Sequence[float], accs: Sequence[float], target: float) -> float | None:
    """Seconds to the first evaluation at or above `target`."""
    return next((t for t, a in zip(times, accs, strict=True) if a >= target), None)


def replans(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's re-partitions: from which round, why, and the stages it moved to."""
    out = []
    for e in events:
        if e.get("event") != "replanned":
            continue
        out.append(
            {
                "round": e.get("from_round"),
                "kind": e.get("kind", ""),
                "reason": str(e.get("reason", ""))[:200],
                "stages": stages_text(e.get("stages") or []),
            }
        )
    return out


def run_one(
    runner: Runner, part: str, cfg: Config, rep: int, job: dict[str, Any], plan: dict[str, Any]
) -> tuple[Run, list[dict[str, Any]]]:
    """Run `job` through `runner` and read its metrics into a Run (and the metrics)."""
    run = Run(part, cfg.name, cfg.mode, cfg.microbatches, cfg.aggregate_every, rep, cfg.lr)
    label = f"{part}-{cfg.name.replace(' ', '').replace('=', '').replace('+', '-')}-{rep}"
    label = label.replace(",", "")
    t0 = time.monotonic()
    events: list[dict[str, Any]] = []
    try:
        code, metrics, events = runner(label, job, plan)
    except Exception as exc:  # one failed run keeps the others
        code, metrics = None, []
        run.note = f"{type(exc).__name__}: {exc}"[:300]
    run.wall_s = time.monotonic() - t0
    if code != 0 and not run.note:
        run.note = f"coordinator exit {code} (logs/{label})"
    run.samples_per_s, run.rounds_s = samples_per_s(metrics, cfg.global_batch)
    run.times, run.accuracies = accuracy_curve(metrics)
    run.stages = stage_timings(metrics)
    run.replans = replans(events)
    print(
        f"{part} {cfg.name} #{rep}: {run.samples_per_s or 0:.1f} samples/s, "
        f"final acc {run.final if run.final is not None else float('nan'):.3f} "
        f"{len(run.replans)} re-partitions {run.note} [{run.wall_s:.0f} s]",
        flush=True,
    )
    return run, metrics


def throughput_part(
    runner: Runner,
    devices: Sequence[str],
    rounds: int,
    reps: int,
    past: Callable[[], bool] = lambda: False,
    save: Callable[[list[Run]], None] = lambda _: None,
    configs: Sequence[Config] | None = None,
    *,
    part: str = "throughput",
    model: Mapping[str, Any] = MODEL,
    data: Mapping[str, Any] = DATA,
    cuts: Sequence[int] | None = None,
) -> list[Run]:
    """Part 1: every configuration `reps` times, interleaved (rep 0 of each, then rep 1...).

    `part` names the set of rows (`THROUGHPUT_SETS`) that trains `model` on `data`,
    stage i on `devices[i]` with layers [cuts[i], cuts[i+1]) (one layer each by default).
    """
    from tests.bench.async_jobs import throughput_configs

    runs: list[Run] = []
    for rep in range(reps):
        for cfg in configs or throughput_configs():
            if past():
                continue
            job = job_for(cfg, "tput", rounds, model=model, data=data)
            if cuts is None:
                plan = plan_for(devices, cfg.microbatches)
            else:
                plan = plan_of(devices, cuts, cfg.microbatches)
            runs.append(run_one(runner, part, cfg, rep, job, plan)[0])
            save(runs)
    return runs


def accuracy_part(
    runner: Runner,
    devices: Sequence[str],
    rounds: int,
    eval_every: int,
    past: Callable[[], bool] = lambda: False,
    save: Callable[[list[Run]], None] = lambda _: None,
    configs: Sequence[Config] | None = None,
) -> list[Run]:
    """Part 3: each configuration once, evaluated every `eval_every` rounds."""
    from tests.bench.async_jobs import accuracy_configs

    runs: list[Run] = []
    for cfg in configs or accuracy_configs(len(devices)):
        if past():
            continue
        job = job_for(cfg, "acc", rounds, eval_every)
        plan = plan_for(devices, cfg.microbatches)
        runs.append(run_one(runner, "accuracy", cfg, 0, job, plan)[0])
        save(runs)
    return runs


def phases(
    metrics: Sequence[dict[str, Any]], global_batch: int, cut_round: int | None, replan: int | None
) -> dict[str, float | None]:
    """Part 2: median samples/s before the throttle, between it and the first re-partition,
    and after that (a round's first after a change is left out: it warms up)."""

    def rate(lo: int, hi: int) -> float | None:
        xs = [float(m["round_s"]) for m in _rounds(metrics) if lo < int(m["round"]) < hi]
        return global_batch / statistics.median(xs) if xs else None

    end = 1 << 30
    if cut_round is None:
        return {"before": rate(0, end), "throttled": None, "after": None}
    if replan is None:
        return {"before": rate(0, cut_round), "throttled": rate(cut_round, end), "after": None}
    return {
        "before": rate(0, cut_round),
        "throttled": rate(cut_round, replan),
        "after": rate(replan, end),
    }
