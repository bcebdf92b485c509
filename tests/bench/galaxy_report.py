"""bench-galaxy's outputs: markdown tables and charts from the measured cells.

Pure functions of the cells (and the planning times), so `--replot` and the
smoke test rebuild every output without a testbed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.bench.galaxy_cells import MODES, Cell

__all__ = ["ms", "speedup", "tables", "write_charts"]

BASELINES = ("megatron", "sp", "local")
"""What galaxy's speedup is taken over, in the order the tables show them."""


def ms(cell: Cell | None) -> str:
    """A cell as the tables show it: measured ms (predicted ms), or why there is none."""
    if cell is None:
        return ""
    pred = "" if cell.predicted_s is None else f" ({1000 * cell.predicted_s:.0f})"
    if cell.state == "ok" and cell.median_s is not None:
        return f"{1000 * cell.median_s:.0f}{pred}"
    return {"oom": "OOM", "failed": "failed", "skipped": "not run"}.get(cell.state, cell.state)


def speedup(fast: Cell | None, slow: Cell | None) -> str:
    """`slow`'s latency over `fast`'s, when both were measured; OOM when `slow` could not run."""
    if fast is None or slow is None or fast.median_s is None:
        return ""
    if slow.state == "oom":
        return "OOM"
    if slow.median_s is None:
        return ""
    return f"{slow.median_s / fast.median_s:.2f}x"


def _key(c: Cell) -> tuple[str, str, float]:
    return c.env, c.model, c.link_mbit


def _by_mode(cells: Sequence[Cell]) -> dict[tuple[str, str, float], dict[str, Cell]]:
    groups: dict[tuple[str, str, float], dict[str, Cell]] = {}
    for c in cells:
        groups.setdefault(_key(c), {})[c.mode] = c
    return groups


def _grid(cells: Sequence[Cell], link_col: bool) -> list[str]:
    modes = [m for m in MODES if any(c.mode == m for c in cells)]
    first = "| env | model (layers) |" + (" link Mbit/s |" if link_col else "")
    head = first + "".join(f" {m} ms |" for m in modes)
    head += "".join(f" galaxy vs {b} |" for b in BASELINES) + " galaxy ms/layer |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (env, model, link), by in _by_mode(cells).items():
        layers = next(iter(by.values())).layers
        row = f"| {env} | {model} ({layers}) |" + (f" {link:g} |" if link_col else "")
        row += "".join(f" {ms(by.get(m))} |" for m in modes)
        galaxy = by.get("galaxy")
        row += "".join(f" {speedup(galaxy, by.get(b))} |" for b in BASELINES)
        per_layer = galaxy.per_layer_ms if galaxy else None
        row += f" {'' if per_layer is None else f'{per_layer:.0f}'} |"
        lines.append(row)
    return lines


def _overlap(cells: Sequence[Cell]) -> list[str]:
    lines = [
        "| env | model (layers) | link Mbit/s | overlap on ms | overlap off ms | off / on |",
        "|---|---|---|---|---|---|",
    ]
    for (env, model, link), by in _by_mode(cells).items():
        on, off = by.get("galaxy"), by.get("galaxy-no-overlap")
        if on is None or off is None:
            continue
        lines.append(
            f"| {env} | {model} ({on.layers}) | {link:g} | {ms(on)} | {ms(off)} | "
            f"{speedup(on, off)} |"
        )
    return lines


def _planning(planning: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| devices | model | plan_galaxy median ms |", "|---|---|---|"]
    lines += [
        f"| {p['devices']} | {p['model']} | {1000 * float(p['seconds']):.2f} |" for p in planning
    ]
    return lines


def _notes(cells: Sequence[Cell]) -> list[str]:
    return [
        f"- {c.part} {c.env} {c.model} ({c.layers}) {c.mode} {c.link_mbit:g} Mbit/s: "
        f"{c.state}: {c.note.strip()}"
        for c in cells
        if c.note.strip()
    ]


def tables(cells: Sequence[Cell], planning: Sequence[dict[str, Any]]) -> list[str]:
    """Every table of results.md, with a heading each."""
    parts: list[tuple[str, list[str]]] = [
        (
            "Latency per request: env x model x mode",
            _grid([c for c in cells if c.part == "grid"], False),
        ),
        ("Bandwidth sweep (Fig. 8)", _grid([c for c in cells if c.part == "sweep"], True)),
        ("Tile overlap on vs off (galaxy)", _overlap([c for c in cells if c.part != "memory"])),
        (
            "Memory: plans that do not fit the budgets",
            _grid([c for c in cells if c.part == "memory"], False),
        ),
        ("Planning time of Algorithm 1", _planning(planning)),
    ]
    lines: list[str] = []
    for title, body in parts:
        if len(body) > 2:
            lines += [f"## {title}", "", *body, ""]
    notes = _notes(cells)
    if notes:
        lines += ["## Notes per cell", "", *notes, ""]
    return lines


STYLE = {
    "galaxy": "tab:blue",
    "galaxy-no-overlap": "tab:cyan",
    "megatron": "tab:orange",
    "sp": "tab:green",
    "local": "tab:gray",
}


def write_charts(out: Path, cells: Sequence[Cell]) -> list[Path]:
    """latency.png (grid: bars measured, dots predicted) and sweep.png (latency vs link)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    grid = [c for c in cells if c.part == "grid"]
    envs = list(dict.fromkeys(c.env for c in grid))
    if envs:
        fig, axes = plt.subplots(1, len(envs), figsize=(3.2 * len(envs), 3.6), squeeze=False)
        for ax, env in zip(axes[0], envs, strict=True):
            here = [c for c in grid if c.env == env]
            models = list(dict.fromkeys(c.model for c in here))
            modes = [m for m in MODES if any(c.mode == m for c in here)]
            width = 0.8 / max(1, len(modes))
            for j, mode in enumerate(modes):
                for i, model in enumerate(models):
                    c = next((c for c in here if c.model == model and c.mode == mode), None)
                    x = i + (j - (len(modes) - 1) / 2) * width
                    if c is not None and c.median_s is not None:
                        ax.bar(
                            x,
                            1000 * c.median_s,
                            width,
                            color=STYLE[mode],
                            label=mode if i == 0 else None,
                        )
                    elif c is not None and c.state == "oom":
                        ax.text(x, 0, "OOM", rotation=90, fontsize=6, ha="center", va="bottom")
                    if c is not None and c.predicted_s is not None:
                        ax.plot(x, 1000 * c.predicted_s, "k.", ms=4)
            ax.set_xticks(range(len(models)), models, fontsize=7)
            ax.set_title(env, fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][0].set_ylabel("ms per request (dots: predicted)")
        axes[0][0].legend(fontsize=6)
        fig.tight_layout()
        written.append(out / "latency.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    sweep = [c for c in cells if c.part == "sweep"]
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for mode in [m for m in MODES if any(c.mode == m for c in sweep)]:
            pts = sorted((c.link_mbit, c) for c in sweep if c.mode == mode)
            xs = [x for x, c in pts if c.median_s is not None]
            ys = [1000 * c.median_s for _, c in pts if c.median_s is not None]
            ax.plot(xs, ys, "o-", color=STYLE[mode], label=mode)
            pred = [(x, 1000 * c.predicted_s) for x, c in pts if c.predicted_s is not None]
            if pred:
                ax.plot(*zip(*pred, strict=True), ":", color=STYLE[mode])
        ax.set_xscale("log")
        ax.set_xlabel("link Mbit/s (dotted: predicted)")
        ax.set_ylabel("ms per request")
        first = sweep[0]
        ax.set_title(f"{first.env}, {first.model} ({first.layers} layers)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "sweep.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
