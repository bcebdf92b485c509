"""Where Eco-FL pays: the five strategies on clustered homes and on evenly spread homes.

    python -m tests.bench.bench_fl --regimes clustered,spread [--out DIR] [--seeds N]

Eco-FL's setting (the slides) is groups of homes "with similar response latency":
clusters of homes, each narrower than the regrouping band, several-fold apart. Homes
spread evenly over a wide range are the other case: the band (``rt_fraction`` 0.5)
cannot hold the initial latency tiers, the homes it misses drop out (they only
probe), and at strong label skew their classes go missing. Both regimes run on the
virtual-clock simulator (real SGD on digits, exact), each with one home slowing 4x
half-way. Every run reports time to 0.7/0.8/0.9 and its regroup count; the table
also says which homes `unheld_homes` names for Eco-FL's initial groups (the warning
the federation gives after its first round).
"""

from __future__ import annotations

import datetime
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from common.fl.data import load_digits_split
from services.federation.band import unheld_homes
from services.federation.simulate import SimConfig, SlowDown
from tests.bench.bench_fl import BenchConfig, Run, run_one, time_to, update_budget, write_plot

__all__ = [
    "BATCH",
    "LOCAL_STEPS",
    "REGIMES",
    "STRATEGIES",
    "TARGETS",
    "Regime",
    "Row",
    "regime_rows",
    "run_regimes",
    "winners",
    "write_regimes",
]

TARGETS = (0.7, 0.8, 0.9)
LOCAL_STEPS, BATCH = 30, 64
"""A home round as bench-fl-homes runs it: 30 SGD steps of batch 64 (lr 0.2)."""
STRATEGIES = ("ecofl/band", "ecofl", "fedavg", "fedasync", "fedat", "astraea")
"""Eco-FL with the federation spec's band (the default), as published, and the baselines."""


@dataclass(frozen=True)
class Regime:
    """Homes' round times (virtual s) and the home that slows 4x half-way."""

    name: str
    round_times: tuple[float, ...]
    slow_home: int
    about: str


REGIMES = {
    "clustered": Regime(
        "clustered",
        (1.0, 1.1, 1.2, 4.0, 4.4, 4.8),
        0,
        "two clusters of three homes, each within +-10 % (inside the band), 4x apart; "
        "home 0 (fast) slows 4x half-way, to the slow cluster's speed",
    ),
    "spread": Regime(
        "spread",
        (1.2, 0.45, 0.9, 2.0, 2.9),
        1,
        "bench-fl-homes' measured round times, spread evenly over 6.4x; home 1 throttled "
        "4x half-way (0.4 to 0.1 cores there)",
    ),
}


def run_regimes(
    names: Sequence[str],
    alphas: Sequence[float],
    seeds: Sequence[int],
    horizon: float,
    log: bool = True,
) -> list[Run]:
    """Every strategy in every regime, alpha and seed; a run's scenario names all three."""
    runs: list[Run] = []
    for name in names:
        reg = REGIMES[name]
        cfg = BenchConfig(
            round_times=reg.round_times,
            strategies=STRATEGIES,
            horizon=horizon,
            target=0.9,
            local_steps=LOCAL_STEPS,
        )
        slow = (SlowDown(reg.slow_home, horizon / 2, 4.0),)
        for alpha in alphas:
            for seed in seeds:
                data = load_digits_split(seed=seed)
                for strategy in STRATEGIES:
                    sim = SimConfig(
                        round_times=reg.round_times,
                        slowdowns=slow,
                        dirichlet_alpha=alpha,
                        local_steps=cfg.local_steps,
                        batch_size=BATCH,
                        seed=seed,
                    )
                    sim = replace(sim, updates=update_budget(strategy, sim, data, cfg))
                    run = run_one(strategy, sim, data, cfg, f"{name}, alpha={alpha:g}")
                    runs.append(run)
                    if log:
                        print(
                            f"{run.scenario} seed {seed} {strategy}: final "
                            f"{run.final_accuracy:.3f}, {len(run.events)} regroups, "
                            f"{run.wall_s:.1f} s",
                            flush=True,
                        )
    return runs


@dataclass(frozen=True)
class Row:
    """A strategy in one regime and alpha, over its seeds."""

    scenario: str
    strategy: str
    times: tuple[float | None, ...]  # median time to each target over the seeds reaching it
    reached: tuple[int, ...]  # seeds reaching each target
    runs: int
    final: float
    tail: float
    regroups: float  # mean regroup events per run


def regime_rows(runs: Sequence[Run]) -> list[Row]:
    """Times to each of `TARGETS`, accuracies and regroups, per scenario and strategy."""
    out = []
    for scenario, strategy in dict.fromkeys((r.scenario, r.strategy) for r in runs):
        group = [r for r in runs if (r.scenario, r.strategy) == (scenario, strategy)]
        hits = [[time_to(r.times, r.accuracies, t) for r in group] for t in TARGETS]
        found = [[h for h in per if h is not None] for per in hits]
        out.append(
            Row(
                scenario,
                strategy,
                tuple(statistics.median(f) if f else None for f in found),
                tuple(len(f) for f in found),
                len(group),
                statistics.fmean(r.final_accuracy for r in group),
                statistics.fmean(r.tail_accuracy for r in group),
                statistics.fmean(len(r.events) for r in group),
            )
        )
    return out


def _rank_key(row: Row) -> tuple[float, ...]:
    """Most seeds to the highest target first, then the earliest median time there."""
    key: list[float] = []
    for t, n in zip(reversed(row.times), reversed(row.reached), strict=True):
        key += [-n, t if t is not None else float("inf")]
    return (*key, -row.tail)


def winners(rows: Sequence[Row]) -> list[str]:
    """Per scenario: the strategy that reaches the highest target in most seeds first."""
    lines = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        group = sorted((r for r in rows if r.scenario == scenario), key=_rank_key)
        order = ", ".join(r.strategy for r in group)
        lines.append(f"- {scenario}: **{group[0].strategy}** wins; order {order}")
    return lines


def unheld_lines(runs: Sequence[Run], names: Sequence[str]) -> list[str]:
    """The federation's first-round warning for Eco-FL's initial groups in each regime."""
    lines = []
    for name in names:
        reg = REGIMES[name]
        firsts = [r for r in runs if r.strategy == "ecofl/band" and r.scenario.startswith(name)]
        for r in firsts[:1] + [x for x in firsts[1:] if x.groups != firsts[0].groups][:2]:
            found = unheld_homes(r.groups, reg.round_times, 0.5)
            said = "none: every home fits its group's band" if found is None else found.warning()
            lines.append(f"- {r.scenario}, seed {r.seed}, groups {list(r.groups)}: {said}")
    return lines


def _t(value: float | None, reached: int, runs: int) -> str:
    return (
        "-"
        if value is None
        else f"{value:.1f}" + ("" if reached == runs else f" ({reached}/{runs})")
    )


def write_regimes(
    out: Path, runs: list[Run], names: Sequence[str], horizon: float, command: str
) -> list[Row]:
    """results.md, results.json and curves.png under ``out``; returns the rows."""
    out.mkdir(parents=True, exist_ok=True)
    rows = regime_rows(runs)
    seeds = sorted({r.seed for r in runs})
    text = [
        "# Eco-FL's regime: clustered homes against evenly spread homes (virtual-clock simulator)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- horizon {horizon:g} virtual s per run, a home slows 4x at {horizon / 2:g} s; "
        f"seeds {seeds}; {LOCAL_STEPS} SGD steps of batch {BATCH} per home round; "
        "2 groups; band rt_fraction 0.5; `ecofl/band` is Eco-FL with the "
        "spec's default latency window 3 and regroup dwell 2, `ecofl` Algorithm 1 as published",
        "- times: median virtual s to the accuracy over the seeds that reached it "
        "((k/n): only k of n seeds did; -: none); regroups: mean events per run",
        *(
            f"- {n}: round times {list(REGIMES[n].round_times)} s; {REGIMES[n].about}"
            for n in names
        ),
        f"- wall-clock of all runs: {sum(r.wall_s for r in runs):.0f} s (one torch thread)",
        "",
        "| regime | strategy | t0.7 (s) | t0.8 (s) | t0.9 (s) | final | last-tenth | regroups |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ts = [_t(t, n, r.runs) for t, n in zip(r.times, r.reached, strict=True)]
        text.append(
            f"| {r.scenario} | {r.strategy} | {' | '.join(ts)} | {r.final:.3f} | "
            f"{r.tail:.3f} | {r.regroups:.1f} |"
        )
    text += ["", "## Winner per regime (most seeds to 0.9, then earliest)", "", *winners(rows)]
    text += ["", "## The federation's warning for Eco-FL's initial groups", ""]
    text += [*unheld_lines(runs, names), ""]
    (out / "results.md").write_text("\n".join(text))
    data = {
        "command": command,
        "regimes": {n: asdict(REGIMES[n]) for n in names},
        "rows": [asdict(r) for r in rows],
        "runs": [asdict(r) for r in runs],
    }
    (out / "results.json").write_text(json.dumps(data, indent=1))
    plot_cfg = BenchConfig(strategies=STRATEGIES, horizon=horizon, target=0.9)
    write_plot(out / "curves.png", runs, plot_cfg)
    return rows
