"""A chaos run's report: events table (md + csv), samples/s plot, invariants, the seed.

Written to the run's output folder: `events.csv`, `report.md` (the seed, the
schedule, the table of every event with its recovery time, the invariants),
`throughput.png` (samples/s per committed round over time, each event a
vertical line labelled with its number and kind) and `samples.csv` (every
RSS / fd / thread sample).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

from tests.chaos.invariants import Check
from tests.chaos.runner import EventRecord, RunResult

COLUMNS = [
    "event",
    "kind",
    "targets",
    "hold_s",
    "detect_s",
    "recovered_s",
    "recovery_s",
    "source",
    "replayed",
    "replan_s",
    "migrate_s",
    "note",
]


def _since(rec: EventRecord, t: float | None) -> str:
    return "" if t is None or rec.injected is None else f"{t - rec.injected:.2f}"


def row(rec: EventRecord) -> dict[str, str]:
    """One event as table cells (seconds from its injection; empty where not seen)."""
    got = rec.recovery
    return {
        "event": str(rec.event.index),
        "kind": rec.event.kind,
        "targets": " ".join(rec.targets),
        "hold_s": f"{rec.event.hold_s:g}" if rec.event.hold_s else "",
        "detect_s": _since(rec, rec.detected),
        "recovered_s": _since(rec, rec.recovered),
        "recovery_s": "" if rec.recovery_s is None else f"{rec.recovery_s:.2f}",
        "source": str(got.get("source", "")) if got.get("kind") == "recovery" else "",
        "replayed": str(got.get("replayed", "")),
        "replan_s": str(got.get("replan_s", "")),
        "migrate_s": str(got.get("migrate_s", "")),
        "note": rec.note,
    }


def markdown_table(rows: Sequence[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


BIN_S = 2.0
"""Width of the bins committed samples are counted in: a stall shows as zeros."""


def committed_rate(result: RunResult, bin_s: float = BIN_S) -> tuple[list[float], list[float]]:
    """Samples committed per second in bins of `bin_s` since the start (0 while nothing commits)."""
    batch = int(result.job.get("global_batch") or 0)
    end = max(result.ended, max((t for t, _ in result.commits), default=result.started))
    bins = [0.0] * (int((end - result.started) / bin_s) + 1)
    for t, _ in result.commits:
        bins[int((t - result.started) / bin_s)] += batch / bin_s
    return [i * bin_s for i in range(len(bins))], bins


def plot(result: RunResult, path: Path) -> None:
    """Samples/s over time since the start, events marked.

    The line counts committed samples in bins of `BIN_S` (so an outage is a
    stretch of zeros); the dots are each round's own rate as the coordinator
    measured it (its compute and communication, without the waits between).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.started
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs, ys = committed_rate(result)
    ax.step(xs, ys, where="post", lw=1.0, label=f"committed samples/s ({BIN_S:g} s bins)")
    rated = [(t, e) for t, e in result.commits if e.get("samples_per_s") is not None]
    rates = [float(e["samples_per_s"]) for _, e in rated]
    ax.plot([t - t0 for t, _ in rated], rates, ".", ms=2.5, alpha=0.6, label="per-round rate")
    top = max([*ys, *rates, 1.0])
    for rec in result.records:
        if rec.injected is None:
            continue
        x = rec.injected - t0
        ax.axvline(x, color="tab:red", lw=0.8, alpha=0.7)
        label = f"{rec.event.index} {rec.event.kind}"
        ax.text(x, top * 1.02, label, rotation=90, fontsize=7, va="bottom", ha="right")
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("samples/s")
    ax.set_ylim(0, top * 1.6)
    ax.set_title(f"chaos run, seed {result.schedule.seed}: {len(result.records)} events")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: RunResult, checks: Sequence[Check], out: Path, backend: str) -> Path:
    """Write every output of the run to `out`; the path of report.md."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [row(r) for r in result.records]
    with (out / "events.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    with (out / "samples.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "process", "pid", "rss_kib", "fds", "threads"])
        for s in result.samples:
            w.writerow([f"{s.t - result.started:.2f}", s.name, s.pid, s.rss_kib, s.fds, s.threads])
    plot(result, out / "throughput.png")
    times = sorted(float(r["recovery_s"]) for r in rows if r["recovery_s"])
    spread = f"max {times[-1]:.2f} s, median {times[len(times) // 2]:.2f} s" if times else "none"
    sched = "\n".join(f"- {e.describe()}" for e in result.schedule.events)
    verdict = "\n".join(f"- [{'x' if c.ok else ' '}] {c.name}: {c.detail}" for c in checks)
    problems = "\n".join(f"- {p}" for p in result.problems) or "- none"
    loads = [load for _, load in result.loads]
    machine = (
        f"1-minute load average {loads[0]:.1f} at the start, {loads[-1]:.1f} at the end "
        f"(max {max(loads):.1f}) on {os.cpu_count()} cores"
        if loads
        else f"{os.cpu_count()} cores, load not sampled"
    )
    text = f"""# Chaos run, seed {result.schedule.seed} ({backend})

{len(result.records)} events in {result.ended - result.started:.0f} s; job {result.job["job_id"]}:
{result.job.get("rounds")} rounds of {result.job.get("global_batch")} samples, optimizer
{result.job.get("optimizer")}. Machine: {machine}.

## Schedule

{sched}

## Events (seconds from each injection)

{markdown_table(rows)}

Recovery (injection to the first committed round after it is back):
{spread}.

## Invariants

{verdict}

## Problems the runner met

{problems}

![samples/s over time](throughput.png)
"""
    path = out / "report.md"
    path.write_text(text)
    return path
