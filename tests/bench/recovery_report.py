"""The recovery bench's runs and its outputs: the table, the CSV and the plot.

Kept apart from the driving (`bench_recovery`) so `--replot` and the tests
redo the outputs from a saved recovery.json without a testbed.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from services.testbed.spec import TestbedSpec
from tests.bench.recovery_parts import Parts

__all__ = ["CHECKPOINT_EVERY", "Run", "header_lines", "write_outputs_from"]

CHECKPOINT_EVERY = 2
"""The failure lands one round after a checkpoint: one committed round is replayed."""


@dataclass
class Run:
    """One job: a device dropped with one recovery mode, or the survivors' fresh plan."""

    device: str
    mode: str  # lightweight, heavy or fresh
    job_id: str
    state: str = "failed"
    note: str = ""
    fault: str = ""
    """How the device was lost: "kill" (SIGKILL of all its processes), "sigstop" (all of
    them stopped: silent, sockets open), "" for a fresh plan."""
    t_submit: float = 0.0
    """Wall time of the submission, then of the job's first `running` (the plot's origin)."""
    t_kill: float | None = None
    """Wall time of the fault (the SIGKILL or the SIGSTOP)."""
    signal: str = ""
    """What declared the loss (`recovery_parts.detection_signal` of the reason)."""
    reason: str = ""
    detect_s: float | None = None
    recover_s: float | None = None
    replayed: int | None = None
    failed_round: int | None = None
    replan_s: float | None = None
    migrate_s: float | None = None
    gap_s: float | None = None
    first_round_s: float | None = None
    """The `recovered` event -> the first round committed after it."""
    round_s: float | None = None
    """Median round seconds before the fault (what one round costs on this plan)."""
    bound_s: float | None = None
    """For a silent loss: heartbeat deadline + probe timeout (in force) + one round."""
    timeouts: str = ""
    """The detection timeouts in force for the job, and where they came from."""
    source: str = ""
    """Where the stages resumed from: "replicas" (survivors and backup nodes) or "checkpoint"."""
    moved_layers: int | None = None
    moved_bytes: int | None = None
    worker_s: float | None = None
    """Seconds the slowest survivor took from its recovery Assign to its Assigned."""
    worker_parts: str = ""
    """That device and where its seconds went (its "stage assigned" log line)."""
    first_commit_s: float | None = None
    """The fault -> the first round committed after the recovery (end to end)."""
    t_cont: float | None = None
    """Wall time the stopped device was let go on (SIGCONT), after the recovery."""
    after_cont: str = ""
    """What the stopped device did once let go, and whether the job took anything from it."""
    ledger: str = ""
    """"ok" when every committed round stands exactly once (`effective_rounds`), else why."""
    before: float | None = None
    after: float | None = None
    stages_before: str = ""
    stages_after: str = ""
    series: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since training started, samples/s) per committed round."""

    def parts(self) -> Parts:
        return Parts(
            self.detect_s,
            self.replan_s,
            self.migrate_s,
            self.gap_s,
            self.first_round_s,
            self.first_commit_s,
        )


def fmt(x: float | int | None, spec: str = ".1f") -> str:
    return "x" if x is None else format(x, spec)


def header_lines(title: str, command: str, load: Sequence[float], spec: TestbedSpec) -> list[str]:
    """A testbed bench report's first lines: what was run, when, on what machine and testbed.

    `load` holds the 1-minute load averages at the start and the end: above the
    core count, other processes slow the devices beyond their quotas.
    """
    cores = len(os.sched_getaffinity(0))
    machine = f"- machine: {platform.machine()}, {cores} cores, Python {platform.python_version()}"
    if load:
        machine += f"; 1-minute load average {load[0]:.1f} at the start, {load[-1]:.1f} at the end"
        if max(load) > cores:
            machine += (
                " (above the core count: other processes slow the devices beyond their "
                "quotas, and samples/s varies between runs)"
            )
    return [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        machine,
        f"- testbed {spec.name}: "
        + ", ".join(
            f"{d.name} {d.cpu:g} cores {d.memory_bytes >> 20} MiB {d.bandwidth_bps / 1e6:g} Mbit/s"
            for d in spec.devices
        ),
    ]


def _median(xs: Sequence[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def summary(runs: list[Run]) -> list[str]:
    """Per device: heavy/lightweight recovery time, lightweight after/fresh throughput."""
    lines = []
    for dev in dict.fromkeys(r.device for r in runs):
        by = {r.mode: r for r in runs if r.device == dev and r.fault in ("kill", "")}
        light, heavy, fresh = by.get("lightweight"), by.get("heavy"), by.get("fresh")
        speed = (
            heavy.recover_s / light.recover_s
            if light and heavy and light.recover_s and heavy.recover_s
            else None
        )
        share = (
            light.after / fresh.after if light and fresh and light.after and fresh.after else None
        )
        vs_heavy = (
            light.after / heavy.after if light and heavy and light.after and heavy.after else None
        )
        lines.append(
            f"- {dev} lost: lightweight recovery {fmt(speed, '.1f')}x faster than heavy "
            f"(paper: >= 14x); lightweight throughput after recovery "
            f"{'x' if share is None else f'{share:.0%}'} of the fresh plan's (paper: >= 90%; "
            f"{'x' if vs_heavy is None else f'{vs_heavy:.0%}'} of heavy recovery's)"
        )
    return lines


def fault_summary(runs: list[Run]) -> list[str]:
    """Fault -> first commit by fault and recovery mode: medians of the total and its parts."""
    lines = []
    groups = dict.fromkeys((r.fault, r.mode) for r in runs if r.fault)
    for fault, mode in groups:
        some = [r for r in runs if (r.fault, r.mode) == (fault, mode)]
        med = Parts(
            *(
                _median([getattr(r, name) for r in some])
                for name in (
                    "detect_s",
                    "replan_s",
                    "migrate_s",
                    "gap_s",
                    "first_round_s",
                    "first_commit_s",
                )
            )
        )
        signals = ", ".join(sorted({r.signal or "?" for r in some}))
        worst = max((r.first_commit_s for r in some if r.first_commit_s is not None), default=None)
        line = (
            f"- {fault}, {mode} ({len(some)} runs; declared by {signals}): median "
            f"{med.named()}; worst {fmt(worst, '.2f')} s"
        )
        if fault == "sigstop":
            bounds = [r.bound_s for r in some if r.bound_s is not None]
            within = sum(
                1
                for r in some
                if r.bound_s is not None
                and r.first_commit_s is not None
                and r.first_commit_s <= r.bound_s
            )
            line += (
                f"; within heartbeat deadline + probe + one round ({fmt(_median(bounds), '.2f')} s"
                f" median) in {within} of {len(some)}"
            )
        lines.append(line)
    return lines


def write_markdown(
    path: Path,
    runs: list[Run],
    spec: TestbedSpec,
    model: str,
    cmd: str,
    load: list[float] | None = None,
) -> None:
    lines = [
        *header_lines("Recovery when a device leaves (Asteroid §5.5)", cmd, load or [], spec),
        f"- model {model}, planner asteroid, checkpoint every {CHECKPOINT_EVERY} rounds; "
        "a device is lost mid-round: kill (SIGKILL of all its processes: its connections "
        "close at once) or sigstop (SIGSTOP of all its processes: silent, its sockets stay "
        "open, as a hang or a power cut looks; SIGCONT once the job recovered)",
        "- fault -> first commit, by part: detect (fault -> job `recovering`), re-plan and "
        "migrate (the `recovered` event's seconds), gap (the rest of `recovering` -> "
        "`recovered`), first round (`recovered` -> the first round committed after it, "
        "the replayed round); Redis stream ids are the times; signal: what declared the "
        "loss (from the recovery's reason)",
        "- samples/s: median round before the fault (first round left out), after the "
        "recovery, and of a fresh job on the survivors; ledger: every committed round "
        "stands exactly once",
        "- worker s: the slowest survivor's own seconds from its recovery Assign to its "
        "reply (part of migrate s)",
        "- lightweight: partition points moved by capacity, only the layers that change hands "
        "move, peer to peer (moved layers / MiB below); heavy: the planner service re-plans, "
        "every layer is gathered in Redis and every stage reloads from there",
        "",
        "## Fault -> first commit, by part",
        "",
        "| device lost | fault | recovery | state | signal | detect s | re-plan s | migrate s "
        "| gap s | first round s | fault -> first commit s | round s before | bound s "
        "| ledger |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if not r.fault:
            continue
        lines.append(
            f"| {r.device} | {r.fault} | {r.mode} | {r.state} | {r.signal} | "
            f"{fmt(r.detect_s, '.2f')} | {fmt(r.replan_s, '.3f')} | {fmt(r.migrate_s, '.3f')} | "
            f"{fmt(r.gap_s, '.3f')} | {fmt(r.first_round_s, '.2f')} | "
            f"{fmt(r.first_commit_s, '.2f')} | {fmt(r.round_s, '.2f')} | "
            f"{fmt(r.bound_s, '.2f')} | {r.ledger} |"
        )
    lines += ["", "## Summary", "", *fault_summary(runs), *summary(runs)]
    lines += [
        "",
        "## Throughput and what moved",
        "",
        "| device lost | fault | recovery | worker s | replayed | from | moved layers "
        "| moved MiB | samples/s before | samples/s after | fresh plan samples/s "
        "| after/fresh | stages after | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        fresh = next((f for f in runs if f.device == r.device and f.mode == "fresh"), None)
        ratio = r.after / fresh.after if r.after and fresh and fresh.after else None
        note = " ".join(x for x in (r.after_cont, r.note.splitlines()[0] if r.note else "") if x)
        lines.append(
            f"| {r.device} | {r.fault or '-'} | {r.mode} | {fmt(r.worker_s, '.3f')} | "
            f"{fmt(r.replayed, 'd')} | {r.source} | {fmt(r.moved_layers, 'd')} | "
            f"{fmt(None if r.moved_bytes is None else r.moved_bytes / 2**20, '.2f')} | "
            f"{fmt(r.before)} | {fmt(r.after)} | {fmt(fresh.after if fresh else None)} | "
            f"{'' if ratio is None or r.mode == 'fresh' else f'{ratio:.0%}'} | "
            f"{r.stages_after} | {note.replace('|', '/')} |"
        )
    timeouts = sorted({r.timeouts for r in runs if r.timeouts})
    if timeouts:
        lines += ["", "## Detection timeouts in force", "", *(f"- {t}" for t in timeouts)]
    parts = [f"- {r.device} {r.fault} {r.mode}: {r.worker_parts}" for r in runs if r.worker_parts]
    if parts:
        lines += ["", "## Slowest survivor's recovery seconds, by part", "", *parts]
    path.write_text("\n".join(lines) + "\n")


CSV_COLUMNS = [f.name for f in fields(Run) if f.name != "series"]


def write_csv(path: Path, runs: list[Run]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in runs:
            w.writerow([getattr(r, c) for c in CSV_COLUMNS])


COLORS = {
    ("kill", "lightweight"): "tab:blue",
    ("kill", "heavy"): "tab:orange",
    ("sigstop", "lightweight"): "tab:green",
    ("sigstop", "heavy"): "tab:red",
}


def write_plot(path: Path, runs: list[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(r.device for r in runs))
    fig, axes = plt.subplots(
        1, len(devices), figsize=(max(6.0, 4 * len(devices)), 3.4), squeeze=False, sharey=True
    )
    for ax, dev in zip(axes[0], devices, strict=True):
        for r in runs:
            if r.device != dev:
                continue
            if r.mode == "fresh":
                if r.after:
                    ax.axhline(r.after, color="gray", ls="--", lw=1, label="fresh plan")
                continue
            color = COLORS.get((r.fault, r.mode), "tab:purple")
            kill = None if r.t_kill is None else r.t_kill - r.t_submit
            # no line across the recovery: no round was trained there
            pieces = (
                [r.series]
                if kill is None
                else [[p for p in r.series if p[0] < kill], [p for p in r.series if p[0] >= kill]]
            )
            for i, piece in enumerate(p for p in pieces if p):
                xs, ys = zip(*piece, strict=True)
                label = f"{r.fault} {r.mode}" if i == 0 else None
                ax.plot(xs, ys, "o-", ms=3, color=color, label=label)
            if kill is not None:
                ax.axvline(kill, color=color, ls=":", lw=1.2)
                if r.first_commit_s is not None:  # no round commits while it recovers
                    ax.axvspan(kill, kill + r.first_commit_s, color=color, alpha=0.12)
        ax.set_title(f"{dev} leaves", fontsize=9)
        ax.set_xlabel("seconds since training started")
        ax.grid(True, alpha=0.3)
    top = max([y for r in runs for _, y in r.series] + [r.after or 0.0 for r in runs] + [1.0])
    axes[0][0].set_ylim(0, 1.1 * top)  # shared by every panel
    axes[0][0].set_ylabel("samples/s per committed round")
    axes[0][-1].legend(fontsize=7)
    fig.text(
        0.5,
        0.005,
        "dotted line: the device is lost (kill or sigstop); shaded: until the first round "
        "commits again",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs_from(
    out: Path,
    runs: list[Run],
    spec: TestbedSpec,
    model: str,
    command: str,
    load: list[float] | None,
) -> str:
    """recovery.md, recovery.csv and recovery.png in `out`; returns the table's text."""
    write_markdown(out / "recovery.md", runs, spec, model, command, load)
    write_csv(out / "recovery.csv", runs)
    write_plot(out / "recovery.png", runs)
    return (out / "recovery.md").read_text()
