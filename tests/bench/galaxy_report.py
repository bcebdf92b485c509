"""bench-galaxy's outputs: markdown tables and charts from the measured cells.

Pure functions of the cells (and the planning times), so `--replot` and the
smoke test rebuild every output without a testbed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.bench.galaxy_cells import CROSSOVER_LINKS, MODES, Cell, split_pays_from

__all__ = ["ms", "plan_text", "ratio", "speedup", "tables", "write_charts"]

BASELINES = ("megatron", "sp", "local")
"""What galaxy's speedup is taken over, in the order the tables show them."""


def ms(cell: Cell | None) -> str:
    """A cell as the tables show it: measured ms (predicted ms), or why there is none."""
    if cell is None:
        return ""
    guess = cell.predicted_dev_s if cell.predicted_dev_s is not None else cell.predicted_s
    pred = "" if guess is None else f" ({1000 * guess:.0f})"
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


def plan_text(cell: Cell) -> str:
    """The plan a cell ran, short: its mode and devices."""
    plan = cell.plan or {}
    return f"{plan.get('mode', '?')} on {'+'.join(plan.get('devices', []))}" if plan else ""


def ratio(cell: Cell | None) -> float | None:
    """Predicted (from the devices' own profiles) over measured latency."""
    if cell is None or cell.median_s is None or cell.predicted_dev_s is None:
        return None
    return cell.predicted_dev_s / cell.median_s


def _choice(cells: Sequence[Cell]) -> list[str]:
    head = (
        "| env | model (layers) | link Mbit/s | auto ms | auto's plan | best other ms (mode) |"
        " auto / best | auto / local | best split / local | auto predicted / measured |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (env, model, link), by in _by_mode(cells).items():
        auto = by.get("auto")
        if auto is None:
            continue
        others = [c for m, c in by.items() if m != "auto" and c.median_s is not None]
        best = min(others, key=lambda c: c.median_s or 0.0, default=None)
        splits = [c for c in others if c.mode != "local"]
        split = min(splits, key=lambda c: c.median_s or 0.0, default=None)
        r = ratio(auto)
        lines.append(
            f"| {env} | {model} ({auto.layers}) | {link:g} | {ms(auto)} | {plan_text(auto)} | "
            f"{'' if best is None else f'{ms(best)} ({best.mode})'} | {speedup(best, auto)} | "
            f"{speedup(by.get('local'), auto)} | {speedup(by.get('local'), split)} | "
            f"{'' if r is None else f'{r:.2f}'} |"
        )
    return lines


def _accuracy(cells: Sequence[Cell]) -> list[str]:
    modes = [m for m in MODES if any(ratio(c) is not None and c.mode == m for c in cells)]
    head = "| env | model (layers) | link Mbit/s |" + "".join(f" {m} |" for m in modes)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    all_ratios = []
    for (env, model, link), by in _by_mode(cells).items():
        got = [ratio(by.get(m)) for m in modes]
        if all(r is None for r in got):
            continue
        all_ratios += [r for r in got if r is not None]
        row = "".join(f" {'' if r is None else f'{r:.2f}'} |" for r in got)
        lines.append(f"| {env} | {model} ({next(iter(by.values())).layers}) | {link:g} |{row}")
    if all_ratios:
        within = sum(abs(r - 1) <= 0.15 for r in all_ratios)
        lines += ["", f"{within} of {len(all_ratios)} predictions within 15 % of the measurement."]
    return lines


def _steps(cells: Sequence[Cell]) -> list[str]:
    lines = ["| env | device | ring step ms (median over its jobs) |", "|---|---|---|"]
    per: dict[tuple[str, str], list[float]] = {}
    for c in cells:
        for d, v in c.step_s.items():
            per.setdefault((c.env, d), []).append(v)
    for (env, d), vs in per.items():
        lines.append(f"| {env} | {d} | {1000 * sorted(vs)[len(vs) // 2]:.2f} |")
    return lines


def _crossover(cells: Sequence[Cell]) -> list[str]:
    head = (
        "| env | model (layers) | split predicted to pay from, Mbit/s | plan there |"
        " predicted speedup over one device there |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for c in cells:
        if c.mode != "auto" or c.part != "grid":
            continue
        got = split_pays_from(c)
        if got is None:
            if c.dev_profiles and c.step_latency_s is not None:
                lines.append(
                    f"| {c.env} | {c.model} ({c.layers}) | not up to {CROSSOVER_LINKS[-1]:g} | | |"
                )
            continue
        mbit, text, gain = got
        lines.append(f"| {c.env} | {c.model} ({c.layers}) | {mbit:g} | {text} | {gain:.2f}x |")
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
        ("The planner's choice (auto) against every mode", _choice(cells)),
        ("Predicted / measured, from the devices' own profiles", _accuracy(cells)),
        ("Ring step cost each device measured when profiling", _steps(cells)),
        ("Where a split starts to pay, by the cost model (memory aside)", _crossover(cells)),
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
    "auto": "tab:red",
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
