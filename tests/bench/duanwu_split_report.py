"""Outputs of the split-device benchmark: table.md, results.json, gain.png, epoch.png (meet.png)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.testbed.spec import parse_cpus
from tests.bench.duanwu_split_common import (
    DEVICE_CORES,
    DEVICES,
    EPOCH_SAMPLES,
    GLOBAL_BATCH,
    VARIANTS,
    fmt,
    pct_shorter,
)
from tests.bench.duanwu_split_epoch import EpochRow
from tests.bench.duanwu_split_gain import WHERE, StageGain, gain_table
from tests.bench.duanwu_split_meet import Meeting, meet_table, plot_meet

__all__ = ["write_outputs"]


def epoch_table(
    rows: Sequence[EpochRow], sim_split: bool, cpu: float, cores: str = DEVICE_CORES
) -> list[str]:
    lines = [
        "## 2. Epoch time, plain vs split pipelining, depth 4, four emulated devices",
        "",
        f"Epoch = {EPOCH_SAMPLES} samples; {DEVICES} devices, each a cpuset of cores "
        f"{cores} with a {cpu:g}-core quota, 1 Gbit/s links, global batch {GLOBAL_BATCH}. "
        "Threads = intra-op threads per device: a split runs one per core (each lane one per "
        "core it owns); plain runs each device at its best unsplit count, the faster of one "
        "per core and one as measured in the device (part 1), so plain is the best unsplit "
        "worker.",
        "",
        "| model | stages | variant | threads | betas | samples/s (median) | runs | epoch s "
        "| vs plain | simulated epoch s | simulated vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    threads_per_core = str(len(parse_cpus(cores)) if cores else 1)
    for r in rows:
        plain = next(x for x in rows if x.model == r.model and x.variant == "plain")
        betas = "—" if r.betas is None else " ".join(f"{b:.2f}" for b in r.betas.values())
        stages = " ".join(f"[{a},{b})" for a, b in r.stages)
        sim = r.sim_epoch_s if (sim_split or r.betas is None) else None
        runs = " / ".join(f"{x:.2f}" for x in r.runs) or "—"
        vs = "" if r is plain else pct_shorter(r.epoch_s, plain.epoch_s)
        sim_vs = "" if r is plain else pct_shorter(sim, plain.sim_epoch_s)
        threads = " ".join(str(n) for n in r.threads.values()) or threads_per_core
        lines.append(
            f"| {r.model} | {stages} | {r.variant} | {threads} | {betas} | "
            f"{fmt(r.samples_per_s, '.2f')} | "
            f"{runs} | {fmt(r.epoch_s)} | {vs} | {fmt(sim)} | {sim_vs} |"
            + (f" {r.note}" if r.note else "")
        )
    return lines


NOTES = [
    "",
    "Notes:",
    "- Part 1: each measurement binds the measuring thread (and so the forward lane's "
    "thread, which inherits its mask) to the cores named; on two cores each lane is pinned "
    "to its own core (per-thread affinity) with one intra-op thread, on one core the lanes "
    "time-slice it. In turn runs the same pair on all the cores with one intra-op thread per "
    "core. 'In the device' is the same measurement run as a process inside each emulated "
    "device (its cpuset and CPU quota): the gain the planner is given for that device. The "
    "planner splits a device only where that gain exceeds its 2 % margin.",
    "- Part 2: samples/s = global batch over the median round after the first, the median "
    "over the runs (variants in alternating order, ABC CBA ABC); the devices have no "
    "priority over this machine's other load (results.json has the load average at each "
    "run). 'planner' is left out where it equals plain or split. The simulator scores the "
    "same plans from a profile measured here at one thread, each device slowed by 1 / its "
    "quota and, where it splits, sped up by its gain measured in the device (as the planner "
    "scores it). Paper (Fig. 5, simulated, depth 4): 5.7 % shorter epochs for AlexNet, 7.3 % for "
    "GoogLeNet. 'vs plain': how much shorter than plain (negative: longer).",
]


def write_outputs(
    out: Path,
    meetings: Sequence[Meeting],
    gains: Sequence[StageGain],
    rows: Sequence[EpochRow],
    header: dict[str, Any],
) -> None:
    """table.md, results.json and the plots of whatever parts ran."""
    out.mkdir(parents=True, exist_ok=True)
    sim_split = bool(header.get("simulator_models_forward_share"))
    lines = [
        "# Duan & Wu's split device on real compute",
        "",
        f"- command: `{header['command']}`",
        f"- date: {header['date']}",
        f"- machine: {header['machine']}",
        f"- simulator models forward_share: {'yes' if sim_split else 'no'}",
        "",
    ]
    if gains:
        lines += [*gain_table(gains), ""]
    for model, choice in dict(header.get("planner_choice") or {}).items():
        lines += [f"The planner's choice for {model}, from the gains in the devices: {choice}.", ""]
    if rows:
        cpu = float(header.get("devices", {}).get("cpu", 0.0))
        cores = str(header.get("devices", {}).get("cores", DEVICE_CORES))
        lines += [*epoch_table(rows, sim_split, cpu, cores), ""]
    if meetings:
        lines += [*meet_table(meetings), ""]
    lines += NOTES
    (out / "table.md").write_text("\n".join(lines) + "\n")
    data = {
        **header,
        "gains": [asdict(g) for g in gains],
        "epoch": [{**asdict(r), "epoch_s": r.epoch_s, "sim_epoch_s": r.sim_epoch_s} for r in rows],
        "meet": [
            {
                **asdict(m),
                "sequential_s": m.sequential_s,
                "premise": [
                    {"beta": b, "forward_over_model": f, "backward_over_model": g}
                    for b, f, g in m.premise()
                ],
            }
            for m in meetings
        ],
    }
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    if gains:
        plot_gain(out / "gain.png", gains)
    if meetings:
        plot_meet(out / "meet.png", meetings)
    if rows:
        plot_epoch(out / "epoch.png", rows, sim_split)


def plot_gain(path: Path, gains: Sequence[StageGain]) -> None:
    """Bars: the split's measured gain per stage, on one core, two cores, inside the device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.0 * len(gains) + 2, 4))
    width = 0.8 / len(WHERE)
    for j, where in enumerate(WHERE):
        for i, g in enumerate(gains):
            value = g.gain(where)
            if value is not None:
                x = i + (j - (len(WHERE) - 1) / 2) * width
                ax.bar(x, value * 100, width, color=f"C{j}", label=where if i == 0 else None)
    ax.axhline(2.0, color="k", ls="--", lw=0.8, label="planner's margin")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(
        range(len(gains)), [f"{g.model}\n{g.device} [{g.layers[0]},{g.layers[1]})" for g in gains]
    )
    ax.set_ylabel("gain of the split over in turn, %")
    ax.set_title("forward+backward pair: in turn vs two lanes", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_epoch(path: Path, rows: Sequence[EpochRow], sim_split: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, ax = plt.subplots(figsize=(2.8 * len(models) + 2, 4))
    width = 0.8 / len(VARIANTS)
    for j, name in enumerate(VARIANTS):
        for i, model in enumerate(models):
            r = next((x for x in rows if (x.model, x.variant) == (model, name)), None)
            plain = next((x for x in rows if (x.model, x.variant) == (model, "plain")), None)
            if r is None:
                continue
            x = i + (j - (len(VARIANTS) - 1) / 2) * width
            if r.epoch_s is not None:
                ax.bar(x, r.epoch_s, width, color=f"C{j}", label=name if i == 0 else None)
                if r is not plain and plain is not None:
                    ax.text(
                        x,
                        r.epoch_s,
                        pct_shorter(r.epoch_s, plain.epoch_s),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
            sim = r.sim_epoch_s if (sim_split or r.betas is None) else None
            if sim is not None:
                ax.plot(x, sim, "_", color="black", markersize=14)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel(f"epoch time, s ({EPOCH_SAMPLES} samples)")
    ax.set_title("depth 4: plain vs split (bars: measured; -: simulated)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
