"""The real-homes FL bench's pure part: curves from the federation's records, the table,
the measured regime (home speeds and round-time noise against the band) and the outputs."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.bench.fl_homes_setup import (
    BATCH,
    FED_DEVICE,
    HOMES,
    LATENCY_WINDOW,
    LOCAL_ROUNDS,
    OPTIMIZER,
    REGROUP_DWELL,
    RT_FRACTION,
    SLOW_CPU,
    SLOW_HOME,
    SPEED_RATIO,
    TARGETS,
    RunResult,
)


def curve_of(entries: Sequence[dict[str, Any]]) -> tuple[list[float], list[float], list[int]]:
    """(time_s, accuracy, version) of each fl-metrics entry that changed the global model.

    Probe rounds (Eco-FL measuring a home outside every group) keep the version; they
    are left out so that a curve is one point per global model.
    """
    times: list[float] = []
    accs: list[float] = []
    versions: list[int] = []
    for e in entries:
        if versions and int(e["version"]) == versions[-1]:
            continue
        times.append(float(e["time_s"]))
        accs.append(float(e["accuracy"]))
        versions.append(int(e["version"]))
    return times, accs, versions


def warmup_end(entries: Sequence[dict[str, Any]]) -> float | None:
    """The federation's clock when its warm-up round (every home's cold start) ended."""
    return next((float(e["time_s"]) for e in entries if e.get("group") == -1), None)


def since_warmup(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries from the warm-up round's end on, their times counted from it.

    Every strategy's warm-up is the same round of all homes, their cold starts
    included; the comparison starts from the first global model it gives.
    """
    warm = warmup_end(entries)
    if warm is None:
        return []
    return [{**e, "time_s": float(e["time_s"]) - warm} for e in entries if e["time_s"] >= warm]


def regroup_events(entries: Sequence[dict[str, Any]]) -> list[tuple[float, int, str, int | None]]:
    """(time_s, home, what, group) of every regrouping the federation reported."""
    out = []
    for e in entries:
        for home, what, group in e.get("regroups") or []:
            out.append((float(e["time_s"]), int(home), str(what), group))
    return out


def round_latencies(entries: Sequence[dict[str, Any]]) -> list[tuple[float, int, float]]:
    """(time_s the round ended, home, its measured latency) of every home in every round.

    The warm-up round (group -1) is left out: its latencies include each home's first
    model download and cold start.
    """
    out = []
    for e in entries:
        if e.get("group") == -1:
            continue
        for home, lat in zip(e.get("members") or [], e.get("latencies") or [], strict=False):
            out.append((float(e["time_s"]), int(home), float(lat)))
    return out


def regime(
    latencies: Sequence[tuple[float, int, float]], until: float | None
) -> dict[str, float | None]:
    """The measured regime before ``until`` (the throttle): speeds and noise.

    ``ratio``: slowest home's median round time over the fastest's. ``noise``: the
    90th percentile of ``|L / median(L) - 1|`` over every home's rounds, the jitter the
    band ``RT^g = rt_fraction * L^g`` has to stand. None where a home has no rounds.
    """
    by_home: dict[int, list[float]] = {}
    for t, h, lat in latencies:
        if until is None or t < until:
            by_home.setdefault(h, []).append(lat)
    if len(by_home) < len(HOMES):
        return {"ratio": None, "noise": None, "fastest": None, "slowest": None}
    medians = {h: statistics.median(v) for h, v in by_home.items()}
    dev = sorted(abs(x / medians[h] - 1) for h, v in by_home.items() for x in v)
    p90 = dev[min(len(dev) - 1, int(0.9 * len(dev)))]
    return {
        "ratio": max(medians.values()) / min(medians.values()),
        "noise": p90,
        "fastest": min(medians.values()),
        "slowest": max(medians.values()),
    }


def time_to(times: Sequence[float], accs: Sequence[float], target: float) -> float | None:
    """Wall-clock seconds (since the federation started) of the first model at `target`."""
    return next((t for t, a in zip(times, accs, strict=True) if a >= target), None)


def row(r: RunResult) -> dict[str, Any]:
    """The table's cells of one run."""
    measured = regime(r.latencies, r.slowed_at_s)
    return {
        "strategy": r.strategy,
        "alpha": r.alpha,
        "slowdown": r.slowdown,
        **{f"t{int(t * 100)}": time_to(r.times, r.accuracies, t) for t in TARGETS},
        "final": r.accuracies[-1] if r.accuracies else None,
        "best": max(r.accuracies) if r.accuracies else None,
        "first_s": r.times[1] if len(r.times) > 1 else None,
        "updates": r.versions[-1] if r.versions else 0,
        "regroups": len(r.regroups),
        "end_s": r.times[-1] if r.times else None,
        "ratio": measured["ratio"],
        "noise": measured["noise"],
        "state": r.state,
    }


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: Sequence[RunResult]) -> list[str]:
    """results.md's table: one line per run, time to each target, final accuracy, updates."""
    targets = " | ".join(f"time to {t:g} (s)" for t in TARGETS)
    lines = [
        f"| strategy | alpha | slow-down | first update (s) | {targets} | final acc | best acc "
        "| updates | regroup events | last update (s) | speed ratio | round noise p90 | state |",
        "|" + "---|" * (12 + len(TARGETS)),
    ]
    for r in results:
        c = row(r)
        times = " | ".join(_cell(c[f"t{int(t * 100)}"], ".0f") for t in TARGETS)
        lines.append(
            f"| {c['strategy']} | {c['alpha']:g} | {'yes' if c['slowdown'] else 'no'} "
            f"| {_cell(c['first_s'], '.0f')} | {times} "
            f"| {_cell(c['final'], '.3f')} | {_cell(c['best'], '.3f')} | {c['updates']} "
            f"| {c['regroups']} | {_cell(c['end_s'], '.0f')} | {_cell(c['ratio'], '.1f')} "
            f"| {_cell(c['noise'], '.2f')} | {c['state']} |"
        )
    return lines


def fastest(results: Sequence[RunResult], alpha: float, target: float) -> list[str]:
    """Strategies at `alpha` ordered by time to `target` (those that never got there last)."""
    runs = [r for r in results if r.alpha == alpha]
    timed = [(time_to(r.times, r.accuracies, target), r.strategy) for r in runs]
    return [s for t, s in sorted(timed, key=lambda x: (x[0] is None, x[0] or 0.0, x[1]))]


def write_outputs(out: Path, header: dict[str, Any], results: Sequence[RunResult]) -> None:
    """results.md and curves.png from what was measured (also --replot)."""
    homes = "; ".join(
        f"home {h}: "
        + ", ".join(f"{n} ({k}) {c:g} cores" for n, k, c in home.devices)
        + f", link {home.link}"
        for h, home in enumerate(HOMES)
    )
    notes = [
        f"# {header.get('title', 'Federated learning across real homes on the edge testbed')}",
        "",
        f"- command: `{header.get('command', '')}`",
        f"- date: {header.get('date', '')}; machine: {header.get('machine', '')}",
        f"- homes: {homes}; CPU quotas {SPEED_RATIO:.1f}x apart; home 0 pipelines fl_cnn "
        "over 2 devices; each home's links at its own rate",
        f"- federation: its own device ({FED_DEVICE[2]:g} cores), link {header.get('wan', '')}"
        ", crossed by every home<->federation transfer; coordinators on the host side",
        f"- per run: {header.get('budget', '')} s budget from the warm-up round's end or "
        f"{header.get('updates', '')} updates; {LOCAL_ROUNDS} local rounds of batch {BATCH} "
        f"per home round, sgd lr {OPTIMIZER['lr']}; digits, Dirichlet alpha, split seed 0",
        f"- band (every strategy's spec; only ecofl regroups): RT^g = {RT_FRACTION:g} L^g on "
        f"the median of a home's last {LATENCY_WINDOW} rounds, {REGROUP_DWELL} consecutive "
        "rounds out of band to move",
        f"- every run: home {SLOW_HOME}'s devices drop to {SLOW_CPU:g} cores at half the budget",
        "- times are seconds since the warm-up round (all homes, their cold starts) ended,"
        " the same round for every strategy; budget and throttle count from there;"
        " accuracy is the global model's on the held-out digits; speed ratio and round noise"
        " (p90 of |round time / the home's median - 1|) are measured before the throttle",
        "",
        *table(results),
        "",
    ]
    for alpha in sorted({r.alpha for r in results}):
        for target in TARGETS:
            order = fastest(results, alpha, target)
            notes.append(f"- alpha {alpha:g}, to {target:g}: " + " < ".join(order))
    notes += [f"- {r.strategy} a{r.alpha:g}: {r.note}" for r in results if r.note]
    (out / "results.md").write_text("\n".join(notes) + "\n")
    write_plot(out / "curves.png", results)


def write_plot(path: Path, results: Sequence[RunResult]) -> None:
    """Accuracy against wall-clock: one panel per alpha, regroup events as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({r.alpha for r in results})
    panels = [(f"alpha {a:g}", [r for r in results if r.alpha == a]) for a in alphas]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.2))
    axes_list = list(axes) if len(panels) > 1 else [axes]
    for ax, (title, runs) in zip(axes_list, panels, strict=False):
        for r in runs:
            (line,) = ax.step(r.times, r.accuracies, where="post", label=r.strategy)
            if r.slowed_at_s is not None:
                ax.axvline(r.slowed_at_s, color="grey", linestyle=":")
            for t, _, _, _ in r.regroups:
                ax.plot([t], [0.05], "x", color=line.get_color())
        ax.set_title(f"{title}; home {SLOW_HOME} throttled at the dotted line")
        ax.set_xlabel("wall-clock s since the warm-up round ended")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(out: Path, header: dict[str, Any], results: Sequence[RunResult]) -> None:
    """results.json after every run, so that a stopped bench keeps what it measured."""
    data = {**header, "runs": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(data, indent=1))


def load(out: Path) -> tuple[dict[str, Any], list[RunResult]]:
    """results.json's header and runs."""
    data = json.loads((out / "results.json").read_text())
    runs = [RunResult(**r) for r in data.pop("runs")]
    for r in runs:
        r.regroups = [(float(t), int(h), str(what), g) for t, h, what, g in r.regroups]
        r.latencies = [(float(t), int(h), float(lat)) for t, h, lat in r.latencies]
    return data, runs
