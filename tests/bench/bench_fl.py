"""Eco-FL against FedAvg, FedAsync, FedAT and Astraea-style grouping: accuracy versus time.

    python -m tests.bench.bench_fl [--out DIR] [--quick] [--seeds N] [--horizon S]
        (make bench-fl)
    python -m tests.bench.bench_fl --regimes clustered,spread [--alphas A,B] [...]
        (clustered against spread homes: `tests.bench.fl_regimes`)

Runs `services.federation.simulate`: real SGD on scikit-learn's digits split over heterogeneous
homes (per-round times 1x to 6x) by Dirichlet(alpha) label skew, alpha 0.1 and 0.5;
time is the simulator's virtual clock (a group's round lasts as long as its slowest
home's), not wall-clock, so runs are exact and repeatable. Every strategy gets the
same virtual-time horizon. A last scenario slows one fast home 4x half-way, so
Eco-FL's run-time regrouping shows (its events are drawn on the plot).
Outputs: DIR/results.md (time to the target accuracy, final accuracy), DIR/results.json
(every curve), DIR/curves.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.fl.data import (
    DIGIT_CLASSES,
    DigitsSplit,
    dirichlet_split,
    label_histogram,
    load_digits_split,
)
from common.fl.spec import FederationSpec
from services.federation.simulate import SimConfig, SlowDown, simulate
from services.federation.strategies import Strategy, make_strategy

__all__ = ["QUICK", "BenchConfig", "Run", "Summary", "main", "run_bench", "summarize"]


@dataclass(frozen=True)
class BenchConfig:
    """What to run; the default takes a few minutes on one core."""

    round_times: tuple[float, ...] = (1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0)
    alphas: tuple[float, ...] = (0.1, 0.5)
    # "name/rt=X" runs a strategy with regrouping band rt_fraction X (default 0.5);
    # "name/band" with the federation spec's default noise-robust band (median, dwell)
    strategies: tuple[str, ...] = (
        "ecofl",
        "ecofl/rt=1",
        "ecofl/band",
        "fedavg",
        "fedasync",
        "fedat",
        "astraea",
    )
    seeds: tuple[int, ...] = (0, 1, 2)
    horizon: float = 120.0  # virtual seconds each run gets
    target: float = 0.8  # accuracy whose first crossing time is reported
    groups: int = 2
    local_steps: int = 10
    slow_home: int = 1  # a fast home (1x) ...
    slow_factor: float = 4.0  # ... turns 4x slower at horizon / 2
    slow_alpha: float = 0.5
    slow_seeds: tuple[int, ...] = (0,)


QUICK = BenchConfig(alphas=(0.5,), strategies=("ecofl", "fedavg"), seeds=(0,), horizon=12.0)


@dataclass(frozen=True)
class Run:
    """One strategy in one scenario and seed: its curve cut at the horizon."""

    scenario: str
    seed: int
    strategy: str
    times: tuple[float, ...]
    accuracies: tuple[float, ...]
    events: tuple[tuple[float, int, str, int | None], ...]
    final_accuracy: float
    tail_accuracy: float  # time-averaged over the horizon's last tenth
    time_to_target: float | None
    wall_s: float
    groups: tuple[tuple[int, ...], ...] = field(default=())


@dataclass(frozen=True)
class Summary:
    """A strategy in a scenario over its seeds."""

    scenario: str
    strategy: str
    final_mean: float
    final_std: float
    tail_mean: float
    reached: int
    runs: int
    time_to_target: float | None  # median over the seeds that reached it


def build_strategy(label: str, groups: int) -> Strategy:
    """A strategy from its bench label: ``name``, ``name/rt=X`` (a wider regrouping band)
    or ``name/band`` (the spec's default latency window and regroup dwell)."""
    if label.endswith("/band"):
        fields = FederationSpec.model_fields
        window, dwell = fields["latency_window"].default, fields["regroup_dwell"].default
        return make_strategy(label.removesuffix("/band"), groups, window=window, dwell=dwell)
    name, _, rt = label.partition("/rt=")
    return make_strategy(name, groups, rt_fraction=float(rt) if rt else 0.5)


Scenario = tuple[str, float, tuple[SlowDown, ...], tuple[int, ...]]
"""A scenario's name, Dirichlet alpha, slow-downs and seeds."""


def scenarios(cfg: BenchConfig) -> list[Scenario]:
    """Every scenario the config asks for: one per alpha, then the slow-down run."""
    out: list[Scenario] = [(f"alpha={a:g}", a, (), cfg.seeds) for a in cfg.alphas]
    slow = SlowDown(cfg.slow_home, cfg.horizon / 2, cfg.slow_factor)
    name = f"alpha={cfg.slow_alpha:g}, home {cfg.slow_home} slows {cfg.slow_factor:g}x"
    out.append((name, cfg.slow_alpha, (slow,), cfg.slow_seeds))
    return out


def update_budget(strategy: str, sim: SimConfig, data: DigitsSplit, cfg: BenchConfig) -> int:
    """Enough global updates to pass the horizon: the initial groups' rate, 25% spare."""
    parts = dirichlet_split(
        data.train_y, len(sim.round_times), sim.dirichlet_alpha, sim.seed, sim.min_size
    )
    hists = [label_histogram(data.train_y[p], DIGIT_CLASSES) for p in parts]
    groups = build_strategy(strategy, cfg.groups).initial_groups(sim.round_times, hists)
    rate = sum(1.0 / max(sim.round_times[h] for h in g) for g in groups if g)
    return math.ceil(1.25 * cfg.horizon * rate) + 2


def time_to(times: tuple[float, ...], accs: tuple[float, ...], target: float) -> float | None:
    """Virtual time of the first global model at or above ``target``."""
    return next((t for t, a in zip(times, accs, strict=True) if a >= target), None)


def accuracy_at(times: tuple[float, ...], accs: tuple[float, ...], t: float) -> float:
    """Accuracy of the newest global model at virtual time ``t`` (a step function)."""
    return next(a for s, a in zip(reversed(times), reversed(accs), strict=True) if s <= t)


def tail_accuracy(times: tuple[float, ...], accs: tuple[float, ...], horizon: float) -> float:
    """Mean accuracy over the horizon's last tenth: asynchronous curves jitter per update."""
    grid = [horizon * (0.9 + 0.1 * i / 20) for i in range(21)]
    return statistics.fmean(accuracy_at(times, accs, t) for t in grid)


def run_one(strategy: str, sim: SimConfig, data: DigitsSplit, cfg: BenchConfig, name: str) -> Run:
    """Simulate, cut the curve at the horizon, measure."""
    start = time.monotonic()
    res = simulate(build_strategy(strategy, cfg.groups), sim, data)
    kept = [p for p in res.curve if p.time <= cfg.horizon]
    times = tuple(p.time for p in kept)
    accs = tuple(p.accuracy for p in kept)
    events = tuple((e.time, e.home, e.action, e.group) for e in res.events if e.time <= cfg.horizon)
    return Run(
        name,
        sim.seed,
        strategy,
        times,
        accs,
        events,
        accs[-1],
        tail_accuracy(times, accs, cfg.horizon),
        time_to(times, accs, cfg.target),
        time.monotonic() - start,
        res.initial_groups,
    )


def run_bench(cfg: BenchConfig, log: bool = True) -> list[Run]:
    """Every strategy in every scenario and seed."""
    runs: list[Run] = []
    for name, alpha, slowdowns, seeds in scenarios(cfg):
        for seed in seeds:
            data = load_digits_split(seed=seed)
            for strategy in cfg.strategies:
                sim = SimConfig(
                    round_times=cfg.round_times,
                    slowdowns=slowdowns,
                    dirichlet_alpha=alpha,
                    local_steps=cfg.local_steps,
                    seed=seed,
                )
                sim = SimConfig(
                    **{**sim.__dict__, "updates": update_budget(strategy, sim, data, cfg)}
                )
                runs.append(run_one(strategy, sim, data, cfg, name))
                r = runs[-1]
                if log:
                    print(
                        f"{name} seed {seed} {strategy}: final {r.final_accuracy:.3f} "
                        f"(tail {r.tail_accuracy:.3f}), "
                        f"{len(r.times) - 1} updates, {r.wall_s:.1f} s",
                        flush=True,
                    )
    return runs


def summarize(runs: list[Run]) -> list[Summary]:
    """Mean and spread of final accuracy, median time to target, per scenario and strategy."""
    keys = list(dict.fromkeys((r.scenario, r.strategy) for r in runs))
    out = []
    for scenario, strategy in keys:
        group = [r for r in runs if (r.scenario, r.strategy) == (scenario, strategy)]
        finals = [r.final_accuracy for r in group]
        hits = [r.time_to_target for r in group if r.time_to_target is not None]
        out.append(
            Summary(
                scenario,
                strategy,
                statistics.fmean(finals),
                statistics.pstdev(finals),
                statistics.fmean(r.tail_accuracy for r in group),
                len(hits),
                len(group),
                statistics.median(hits) if hits else None,
            )
        )
    return out


def table(rows: list[Summary], target: float) -> list[str]:
    """The results table as markdown lines."""
    lines = [
        f"| scenario | strategy | time to {target:.0%} (s, median) | reached | "
        "final accuracy (mean +- sd) | last-tenth accuracy |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in rows:
        ttt = "-" if s.time_to_target is None else f"{s.time_to_target:.1f}"
        lines.append(
            f"| {s.scenario} | {s.strategy} | {ttt} | {s.reached}/{s.runs} | "
            f"{s.final_mean:.3f} +- {s.final_std:.3f} | {s.tail_mean:.3f} |"
        )
    return lines


def direction(rows: list[Summary]) -> list[str]:
    """Eco-FL's margin over each baseline (last-tenth accuracy): the slides claim Eco-FL best."""
    lines = []
    for scenario in dict.fromkeys(s.scenario for s in rows):
        group = {s.strategy: s for s in rows if s.scenario == scenario}
        if "ecofl" not in group:
            continue
        eco = group["ecofl"].tail_mean
        rank = 1 + sum(s.tail_mean > eco for s in group.values())
        margins = ", ".join(
            f"{n} {eco - s.tail_mean:+.3f}" for n, s in group.items() if n != "ecofl"
        )
        lines.append(f"- {scenario}: Eco-FL {eco:.3f}, rank {rank}/{len(group)}; {margins}")
    return lines


def write_outputs(out: Path, runs: list[Run], cfg: BenchConfig, command: str) -> list[Summary]:
    """results.md, results.json and curves.png; returns the summary rows."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs)
    head = [
        "# Eco-FL and baselines on the virtual-clock simulator (digits, non-IID)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- homes: {len(cfg.round_times)}, round times {list(cfg.round_times)} virtual s; "
        f"{cfg.groups} groups; K = {cfg.local_steps} SGD steps per round; seeds {list(cfg.seeds)}",
        f"- horizon {cfg.horizon:g} virtual s per run; target accuracy {cfg.target:.0%}; "
        "held-out digits (25%); time is virtual, not measured; regrouping band "
        "rt_fraction 0.5 unless the label says `/rt=`",
        f"- wall-clock of all runs: {sum(r.wall_s for r in runs):.0f} s (one torch thread)",
        "",
    ]
    slow = [r for r in runs if r.strategy.startswith("ecofl") and r.events]
    evs = [
        f"- {r.scenario}, {r.strategy}, seed {r.seed}: "
        + ", ".join(
            f"t={t:.0f} home {h} {a}" + ("" if g is None else f" -> group {g}")
            for t, h, a, g in r.events
        )
        for r in slow
    ]
    text = head + table(rows, cfg.target) + ["", "## Eco-FL's direction", ""] + direction(rows)
    first = [r for r in runs if r.seed == min(x.seed for x in runs) and r.groups]
    grouped = [f"- {r.scenario}, {r.strategy}: {r.groups}" for r in first]
    text += ["", "## Eco-FL regroup events", "", *(evs or ["- none"])]
    text += ["", "## Initial groups (home ids; first seed)", "", *grouped, ""]
    (out / "results.md").write_text("\n".join(text))
    data = {
        "config": asdict(cfg),
        "command": command,
        "summary": [asdict(s) for s in rows],
        "runs": [asdict(r) for r in runs],
    }
    (out / "results.json").write_text(json.dumps(data, indent=1))
    write_plot(out / "curves.png", runs, cfg)
    return rows


def write_plot(path: Path, runs: list[Run], cfg: BenchConfig) -> None:
    """One panel per scenario: seed-mean accuracy on a time grid, regroup events dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.scenario for r in runs))
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.0), squeeze=False)
    grid = [cfg.horizon * i / 200 for i in range(201)]
    colors = plt.get_cmap("tab10")
    for ax, name in zip(axes[0], names, strict=True):
        for j, strategy in enumerate(cfg.strategies):
            group = [r for r in runs if (r.scenario, r.strategy) == (name, strategy)]
            if not group:
                continue
            mean = [
                statistics.fmean(accuracy_at(r.times, r.accuracies, t) for r in group) for t in grid
            ]
            ax.plot(grid, mean, color=colors(j), label=strategy, lw=2 if strategy == "ecofl" else 1)
            for r in group if strategy.startswith("ecofl") else []:
                for t, home, action, _ in r.events:
                    ax.axvline(t, color=colors(j), ls="--", lw=0.8)
                    ax.text(t, 0.05, f" home {home} {action}", rotation=90, fontsize=7)
        ax.axhline(cfg.target, color="grey", lw=0.5, ls=":")
        ax.set(title=name, xlabel="virtual time (s)", ylim=(0, 1))
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy (mean over seeds)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its outputs; exit code 0 on success."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/fl"))
    parser.add_argument("--quick", action="store_true", help="2 strategies, 1 seed, short")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per scenario")
    parser.add_argument("--horizon", type=float, default=None, help="virtual seconds per run")
    parser.add_argument(
        "--regimes", default=None, help="clustered,spread: Eco-FL's regime against spread homes"
    )
    parser.add_argument("--alphas", default="0.1,0.5", help="with --regimes: Dirichlet alphas")
    args = parser.parse_args(argv)
    if args.regimes is not None:
        return _regimes(args, " ".join(["python -m tests.bench.bench_fl", *(argv or sys.argv[1:])]))
    cfg = QUICK if args.quick else BenchConfig()
    if args.seeds is not None:
        cfg = BenchConfig(**{**cfg.__dict__, "seeds": tuple(range(args.seeds))})
    if args.horizon is not None:
        cfg = BenchConfig(**{**cfg.__dict__, "horizon": args.horizon})
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    command = " ".join(["python -m tests.bench.bench_fl", *(argv or sys.argv[1:])])
    runs = run_bench(cfg)
    rows = write_outputs(args.out, runs, cfg, command)
    print("\n".join(table(rows, cfg.target)))
    print(f"wrote {args.out}/results.{{md,json}} and curves.png")
    return 0


def _regimes(args: argparse.Namespace, command: str) -> int:
    """``--regimes``: the five strategies on clustered and on spread homes."""
    from tests.bench.fl_regimes import REGIMES, run_regimes, write_regimes

    names = [n for n in args.regimes.split(",") if n]
    if not names or any(n not in REGIMES for n in names):
        raise SystemExit(f"--regimes takes names from {sorted(REGIMES)}, got {args.regimes!r}")
    alphas = [float(a) for a in args.alphas.split(",")]
    seeds = range(args.seeds if args.seeds is not None else 3)
    horizon = args.horizon if args.horizon is not None else 40.0
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    runs = run_regimes(names, alphas, seeds, horizon)
    write_regimes(args.out, runs, names, horizon, command)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
