"""A picture of a simulated round: one row per device, like Asteroid's Fig. 4b.

Seeing where the bubbles sit (warm-up, a slow stage, a saturated link, the
all-reduce tail) explains a plan's latency faster than any number does, so
planners and benchmarks write these next to their results.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from common.extras import require
from common.plan import Plan
from services.planner.simulator import Event, SimResult

__all__ = ["draw_timeline"]

_COLORS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "act": "#55A868",
    "grad": "#C44E52",
    "allreduce": "#8172B3",
    "idle": "#E6E6E6",
}
_LABELS = {
    "F": "forward",
    "B": "backward",
    "act": "send activations",
    "grad": "send gradients",
    "allreduce": "all-reduce",
    "idle": "idle (bubble)",
}
# vertical layout inside one device row (row height 1, y grows downward)
_COMPUTE = (0.12, 0.56)
_SEND = (0.72, 0.16)


def draw_timeline(result: SimResult, plan: Plan, path: Path, title: str = "") -> None:
    """Write a PNG of `result`'s events for `plan` to `path`.

    Rows are the plan's devices grouped by stage ("s0 dev-a"), compute boxes
    are labelled with their micro-batch ("F3", "B3") where they are wide
    enough, sends sit in a thin strip under their sender's compute, and every
    moment a device computes nothing shows as light grey. Matplotlib is
    imported here so that planners that never draw do not pay for it.
    """
    require("matplotlib", "a timeline picture")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [(s, str(a.device)) for s, stage in enumerate(plan.stages) for a in stage.devices]
    row_of = {dev: i for i, (_, dev) in enumerate(rows)}
    stage_of = {dev: s for s, dev in rows}
    total_ms = max(result.round_s * 1e3, 1e-9)

    fig = Figure(figsize=(13, 1.2 + 0.55 * len(rows)), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    px_per_ms = fig.get_figwidth() * fig.dpi * 0.8 / total_ms

    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in result.events:
        if e.kind == "recv" or e.device not in row_of:
            continue
        key = _style(e, stage_of)
        bars[row_of[e.device], key].append((e.start * 1e3, (e.end - e.start) * 1e3))

    for i in range(len(rows)):
        ax.broken_barh([(0.0, total_ms)], (i + _COMPUTE[0], _COMPUTE[1]), color=_COLORS["idle"])
    for (i, key), spans in bars.items():
        y, h = _SEND if key in ("act", "grad") else _COMPUTE
        ax.broken_barh(
            spans,
            (i + y, h),
            facecolors=_COLORS[key],
            edgecolors="white" if key in ("F", "B") else "none",
            linewidth=0.6,
            alpha=0.75 if key in ("act", "grad") else 1.0,
        )

    for e in result.events:
        if e.kind in ("F", "B", "allreduce") and e.device in row_of:
            label = "AR" if e.kind == "allreduce" else f"{e.kind}{e.mb}"
            if (e.end - e.start) * 1e3 * px_per_ms > 7 * len(label) + 4:
                ax.text(
                    (e.start + e.end) / 2 * 1e3,
                    row_of[e.device] + _COMPUTE[0] + _COMPUTE[1] / 2,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )

    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.02, color="#555555", linewidth=0.8)
    ax.set_yticks([i + 0.5 for i in range(len(rows))])
    ax.set_yticklabels([f"s{s} {dev}" for s, dev in rows])
    ax.set_ylim(len(rows), 0)
    ax.set_xlim(0, total_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    summary = (
        f"round {result.round_s * 1e3:.1f} ms, {result.throughput:.1f} samples/s, "
        f"bubble {result.bubble_fraction:.0%}, M={plan.microbatches}"
    )
    ax.set_title(f"{title}\n{summary}" if title else summary, fontsize=10)
    kinds = sorted({k for _, k in bars} | {"idle"}, key=list(_COLORS).index)
    ax.legend(
        handles=[Patch(color=_COLORS[k], label=_LABELS[k]) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.9 / (1.2 + 0.55 * len(rows))),
        ncol=len(kinds),
        frameon=False,
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path)


def _style(e: Event, stage_of: dict[str, int]) -> str:
    """Colour key of an event; a send is activations when its peer is downstream."""
    if e.kind != "send":
        return e.kind
    return "act" if stage_of.get(e.peer, -1) > stage_of[e.device] else "grad"
