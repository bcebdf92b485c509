"""Planner benchmark in simulation: Asteroid against its baselines on the paper's environments.

    python -m tests.bench.bench_simulation [--out DIR] [--quick] [--refresh]
                                           [--resolution {imagenet,uniform}]

The shape of Asteroid's Table 4 and Fig. 13: for each environment (§6: A = 5
Nano, B = 3 Xavier NX + 2 TX2, C = 1 NX + 2 TX2 + 3 Nano, D = 1 TX2 + 3 Nano),
link speed (100 Mbps, 1 Gbps) and model, every planner except `optimal` (too
slow on these sizes) makes a plan, the discrete-event simulator runs one round
of it, and the report gives samples/s, "x" where the plan does not fit the
devices' memory (the paper's marks; memory-aware planners raise instead), and
Asteroid's speedup over each baseline whose plan fits.

Devices. One CPU core profiles each model here (torch pinned to one thread);
that core stands for the Xavier NX, and the TX2 and Nano are slowed by the ratio
of peak throughputs of Asteroid's Table 1 (`services.testbed.presets`). Memory budgets are
the boards' full memory.

Resolution emulation. Our image models take 32x32 inputs, the paper trains at
224x224, so per-layer times, output bytes and activation bytes (not parameters
or optimizer state) of image models are scaled up; bert_small is left as is.
The zoo's image models are CIFAR adaptations that skip two of ImageNet's
stride-2 downsamplings early (see common/zoo), so their feature maps are 4x
larger on a side than the ImageNet models' at the same input size. Scaling
them by (224/32)^2 = 49 would model our architectures at 224 px, with 16x the
activations of the paper's ImageNet models (ResNet-50: 1.6 GB per sample).
`--resolution imagenet` (the default) scales each layer by (224/32)^2 divided
by the square of the downsampling the CIFAR adaptation has dropped up to that
layer: 49/4 = 12.25 for layers still at the ImageNet stem's resolution, 49/16 =
3.06 after both dropped strides, which matches the ImageNet models' feature
map sizes layer by layer. `--resolution uniform` applies the flat factor 49.

Batch geometry. Global batch 256 (bert_small: 64) in 8 micro-batches: 8 gives
the pipelines room to fill (5-6 stages at most here) while keeping micro-batches
of 32 (bert_small: 8) samples, within the profiled batch sizes.

Profiles are cached as JSON under DIR/profiles/<model>.json (unscaled; scaling
happens on load) and reused unless `--refresh` or they lack a batch size the
run asks for. Exit code 0 when the run completed, 1 when it failed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.errors import AsteroidError
from common.profile import Profile
from common.zoo import ModelSpec
from services.planner.base import PlanDoesNotFit, check_memory
from services.planner.cost import CostModel
from services.planner.registry import PLANNERS, get_planner
from services.planner.simulator import simulate
from services.profiler.layers import profile_model
from services.testbed.presets import JETSON_XAVIER_NX, cluster_for, environment

PAPER_RES, OUR_RES = 224, 32
IMAGE_MODELS = ("mobilenet_v2", "efficientnet_b1", "resnet50")
# Layer index -> downsampling of ImageNet's model that the CIFAR adaptation drops
# there (common/zoo): the stride-2 stem, and the first block of the 24-channel
# stage (MobileNetV2, EfficientNet-B1) or the 3x3 max-pool after the stem (ResNet).
DROPPED_DOWNSAMPLING: dict[str, dict[int, int]] = {
    "mobilenet_v2": {0: 2, 2: 2},
    "efficientnet_b1": {0: 2, 3: 2},
    "resnet50": {0: 4},
}
PLANNER_ORDER = ("asteroid", "dp", "gpipe", "pipedream", "dapple", "hetpipe", "duanwu")
EXCLUDED = ("optimal",)  # exhaustive: raises ConfigError on instances this size
BANDWIDTHS_BPS = (100e6, 1e9)
FIT, NOFIT, FAILED = "fits", "does not fit", "failed"


@dataclass(frozen=True)
class Config:
    """What to run; `quick` trades coverage for a run under two minutes."""

    models: tuple[str, ...] = ("mobilenet_v2", "efficientnet_b1", "resnet50", "bert_small")
    envs: tuple[str, ...] = ("A", "B", "C", "D")
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    repeats: int = 3
    warmup: int = 1
    microbatches: int = 8
    resolution: str = "imagenet"


QUICK = Config(
    models=("mobilenet_v2", "bert_small"),
    envs=("A", "C"),
    batch_sizes=(1, 4, 16, 32),
    repeats=2,
    warmup=1,
)


def global_batch(model: str) -> int:
    return 64 if model == "bert_small" else 256


@dataclass(frozen=True)
class Row:
    """One planner on one model, environment and link speed."""

    env: str
    bandwidth_bps: float
    model: str
    planner: str
    status: str = FAILED  # FIT, NOFIT or FAILED
    plan_s: float = 0.0  # wall-clock seconds the planner took
    detail: str = ""  # memory violations or the failure
    throughput: float | None = None  # samples/s of the simulated round; None when no plan
    round_s: float | None = None
    bubble: float | None = None
    stages: int | None = None

    @property
    def link(self) -> str:
        return link_label(self.bandwidth_bps)


def link_label(bps: float) -> str:
    return f"{bps / 1e9:g} Gbps" if bps >= 1e9 else f"{bps / 1e6:g} Mbps"


# --- profiles ---------------------------------------------------------------------


def load_or_profile(model: str, cfg: Config, cache: Path, refresh: bool) -> Profile:
    """The cached profile of `model` if it covers `cfg.batch_sizes`, else a fresh one."""
    path = cache / f"{model}.json"
    if path.exists() and not refresh:
        prof = Profile.model_validate_json(path.read_text())
        if set(cfg.batch_sizes) <= set(prof.batch_sizes):
            print(f"profile {model}: cached {path}", flush=True)
            return prof
    start = time.monotonic()
    prof = profile_model(
        ModelSpec(name=model),
        batch_sizes=list(cfg.batch_sizes),
        repeats=cfg.repeats,
        warmup=cfg.warmup,
    )
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.model_dump_json(indent=1))
    print(f"profile {model}: measured in {time.monotonic() - start:.0f} s", flush=True)
    return prof


def resolution_factors(model: str, num_layers: int, mode: str) -> list[float]:
    """Per-layer factor taking `model` from 32 px to the paper's 224 px (module docstring)."""
    if model not in IMAGE_MODELS:
        return [1.0] * num_layers
    area = (PAPER_RES / OUR_RES) ** 2
    if mode == "uniform":
        return [area] * num_layers
    dropped, out = 1, []
    for i in range(num_layers):
        dropped *= DROPPED_DOWNSAMPLING[model].get(i, 1)
        out.append(area / dropped**2)
    return out


def scale_profile(prof: Profile, factors: list[float]) -> Profile:
    """`prof` with times, output and activation bytes of layer i multiplied by factors[i]."""
    layers = [
        lp.model_copy(
            update={
                "forward_s": [t * f for t in lp.forward_s],
                "backward_s": [t * f for t in lp.backward_s],
                "output_bytes": round(lp.output_bytes * f),
                "activation_bytes": round(lp.activation_bytes * f),
            }
        )
        for lp, f in zip(prof.layers, factors, strict=True)
    ]
    return prof.model_copy(update={"layers": layers})


# --- planning and simulation ------------------------------------------------------


def planner_names() -> list[str]:
    names = [n for n in PLANNERS if n not in EXCLUDED]
    return sorted(names, key=lambda n: (PLANNER_ORDER.index(n) if n in PLANNER_ORDER else 99, n))


def evaluate(env: str, bps: float, model: str, planner: str, cost: CostModel, cfg: Config) -> Row:
    """Plan with `planner`, check memory, simulate one round."""
    row = Row(env, bps, model, planner)
    start = time.monotonic()
    try:
        plan = get_planner(planner).plan(cost, global_batch(model), cfg.microbatches)
    except PlanDoesNotFit as exc:
        return replace(row, status=NOFIT, plan_s=time.monotonic() - start, detail=str(exc))
    except AsteroidError as exc:
        detail = f"{type(exc).__name__}: {exc}"
        return replace(row, plan_s=time.monotonic() - start, detail=detail)
    row = replace(row, plan_s=time.monotonic() - start)
    violations = check_memory(plan, cost)
    try:
        sim = simulate(plan, cost)
    except AsteroidError as exc:
        return replace(row, detail=f"simulation: {exc}")
    return replace(
        row,
        status=NOFIT if violations else FIT,
        detail="; ".join(violations),
        throughput=sim.throughput,
        round_s=sim.round_s,
        bubble=sim.bubble_fraction,
        stages=len(plan.stages),
    )


def run(cfg: Config, out: Path, refresh: bool) -> list[Row]:
    names = planner_names()
    rows: list[Row] = []
    for model in cfg.models:
        raw = load_or_profile(model, cfg, out / "profiles", refresh)
        prof = scale_profile(raw, resolution_factors(model, len(raw.layers), cfg.resolution))
        key = f"{model}@{JETSON_XAVIER_NX.prefix}"
        for env in cfg.envs:
            for bps in BANDWIDTHS_BPS:
                cost = CostModel({key: prof}, cluster_for(env, bps, key))
                for planner in names:
                    rows.append(evaluate(env, bps, model, planner, cost, cfg))
                    r = rows[-1]
                    if r.plan_s > 5:
                        print(f"  {planner} on {model} {env} {r.link}: {r.plan_s:.0f} s")
        print(f"planned and simulated {model}", flush=True)
    return rows


# --- report -----------------------------------------------------------------------


def speedup(rows: list[Row], ref: Row) -> str:
    """Asteroid's throughput over `ref`'s, where both made plans that fit."""
    ast = next(
        (
            r
            for r in rows
            if (r.env, r.bandwidth_bps, r.model, r.planner)
            == (ref.env, ref.bandwidth_bps, ref.model, "asteroid")
        ),
        None,
    )
    if ast is None or ast.status != FIT or ast.throughput is None:
        return "-"
    if ref.status == NOFIT:
        return "x"
    if ref.status == FAILED or ref.throughput is None:
        return "-"
    return f"{ast.throughput / ref.throughput:.2f}x"


def cell(r: Row) -> str:
    """Throughput, or "x" for a plan over the memory budgets (its figure in parentheses)."""
    if r.status == FAILED or r.throughput is None:
        return "x" if r.status == NOFIT else "failed"
    return f"x ({r.throughput:.3g})" if r.status == NOFIT else f"{r.throughput:.3g}"


def panels(rows: list[Row]) -> list[tuple[str, float]]:
    seen: dict[tuple[str, float], None] = {}
    for r in rows:
        seen[(r.env, r.bandwidth_bps)] = None
    return list(seen)


def env_label(env: str) -> str:
    kinds = " + ".join(f"{n} {k.name.removeprefix('Jetson ')}" for k, n in environment(env))
    return f"Env {env} ({kinds})"


def print_table(rows: list[Row], names: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Simulated training throughput, samples/s (x: plan exceeds device memory)")
    for h in ("env", "link", "model", *names, "best baseline that fits"):
        table.add_column(h, justify="left" if h in ("env", "link", "model") else "right")
    for env, bps in panels(rows):
        models = list(dict.fromkeys(r.model for r in rows))
        for model in models:
            group = [r for r in rows if (r.env, r.bandwidth_bps, r.model) == (env, bps, model)]
            by = {r.planner: r for r in group}
            cells = []
            for n in names:
                c = cell(by[n])
                style = "red" if by[n].status != FIT else ("bold green" if n == "asteroid" else "")
                cells.append(f"[{style}]{c}[/]" if style else c)
            table.add_row(env, link_label(bps), model, *cells, best_baseline(group))
        table.add_section()
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def best_baseline(group: list[Row]) -> str:
    """The fastest baseline plan that fits, and Asteroid's speedup over it."""
    fit = [r for r in group if r.planner != "asteroid" and r.status == FIT and r.throughput]
    if not fit:
        return "none fits"
    best = max(fit, key=lambda r: r.throughput or 0.0)
    return f"{best.planner} ({speedup(group, best)})"


def _machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, nproc "
        f"{len(os.sched_getaffinity(0))}, Python {platform.python_version()}, "
        f"torch {torch.__version__} (1 thread)"
    )


def write_markdown(
    path: Path, rows: list[Row], names: list[str], command: str, cfg: Config
) -> None:
    lines = [
        "# Planner benchmark in simulation (Asteroid Table 4 / Fig. 13 shape)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {_machine()}",
        f"- profiles: batch sizes {list(cfg.batch_sizes)}, median of {cfg.repeats} runs "
        f"after {cfg.warmup} warm-up; the profiled core is the Xavier NX, TX2 and Nano "
        "slowed by Asteroid Table 1's peak-throughput ratios",
        f"- resolution emulation: `{cfg.resolution}` (image models scaled to 224 px, see "
        "the module docstring); bert_small unscaled",
        f"- global batch 256 (bert_small 64), {cfg.microbatches} micro-batches; one "
        "simulated 1F1B round per plan; planners: "
        + ", ".join(names)
        + f" (not {', '.join(EXCLUDED)})",
        "- cells: samples/s; `x` marks a plan over a device's memory budget (memory-aware "
        "planners raise instead: plain `x`), with the simulated figure in parentheses "
        "when the planner returned the plan anyway; `failed`: no plan (see the CSV)",
        "- speedup: Asteroid's throughput over the baseline's, only where both plans fit",
        "",
    ]
    models = list(dict.fromkeys(r.model for r in rows))
    for env, bps in panels(rows):
        lines += [f"## {env_label(env)}, {link_label(bps)}", ""]
        lines += ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for model in models:
            by = {
                r.planner: r for r in rows if (r.env, r.bandwidth_bps, r.model) == (env, bps, model)
            }
            lines.append(f"| {model} | " + " | ".join(cell(by[n]) for n in names) + " |")
        others = [n for n in names if n != "asteroid"]
        lines += ["", "Asteroid speedup:", ""]
        lines += ["| model | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
        for model in models:
            by = {
                r.planner: r for r in rows if (r.env, r.bandwidth_bps, r.model) == (env, bps, model)
            }
            group = list(by.values())
            lines.append(f"| {model} | " + " | ".join(speedup(group, by[n]) for n in others) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def write_csv(path: Path, rows: list[Row]) -> None:
    fields = [
        "env",
        "link_bps",
        "model",
        "planner",
        "status",
        "throughput_sps",
        "round_s",
        "bubble_fraction",
        "stages",
        "plan_s",
        "asteroid_speedup",
        "detail",
    ]
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        out.writeheader()
        for r in rows:
            group = [
                g
                for g in rows
                if (g.env, g.bandwidth_bps, g.model) == (r.env, r.bandwidth_bps, r.model)
            ]
            out.writerow(
                {
                    "env": r.env,
                    "link_bps": f"{r.bandwidth_bps:.0f}",
                    "model": r.model,
                    "planner": r.planner,
                    "status": r.status,
                    "throughput_sps": "" if r.throughput is None else f"{r.throughput:.6g}",
                    "round_s": "" if r.round_s is None else f"{r.round_s:.6g}",
                    "bubble_fraction": "" if r.bubble is None else f"{r.bubble:.4f}",
                    "stages": "" if r.stages is None else r.stages,
                    "plan_s": f"{r.plan_s:.3f}",
                    "asteroid_speedup": "" if r.planner == "asteroid" else speedup(group, r),
                    "detail": r.detail,
                }
            )


def write_plot(path: Path, rows: list[Row], names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = panels(rows)
    envs = list(dict.fromkeys(e for e, _ in grid))
    links = list(dict.fromkeys(b for _, b in grid))
    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(
        len(links), len(envs), figsize=(4.2 * len(envs), 3.6 * len(links)), squeeze=False
    )
    width = 0.8 / len(names)
    colors = plt.get_cmap("tab10")
    for (env, bps), ax in zip(
        grid, [axes[links.index(b)][envs.index(e)] for e, b in grid], strict=True
    ):
        floor = min((r.throughput for r in rows if r.throughput), default=1.0) / 2
        for j, name in enumerate(names):
            xs, ys, marks = [], [], []
            for i, model in enumerate(models):
                r = next(
                    r
                    for r in rows
                    if (r.env, r.bandwidth_bps, r.model, r.planner) == (env, bps, model, name)
                )
                x = i + (j - (len(names) - 1) / 2) * width
                if r.status == FIT and r.throughput:
                    xs.append(x)
                    ys.append(r.throughput)
                elif r.status == NOFIT:
                    marks.append(x)
            ax.bar(xs, ys, width, color=colors(j), label=name)
            ax.plot(
                marks,
                [floor * 1.3] * len(marks),
                "x",
                color=colors(j),
                markersize=7,
                markeredgewidth=2,
            )
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor)
        ax.set_xticks(range(len(models)), [m.replace("_", "\n", 1) for m in models], fontsize=8)
        ax.set_title(f"Env {env}, {link_label(bps)}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("samples/s (log)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(names), frameon=False)
    fig.text(
        0.5,
        0.005,
        "x: the planner's plan exceeds a device's memory (or no plan fits)",
        ha="center",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.94))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/simulation"))
    parser.add_argument("--quick", action="store_true", help="2 models, Env A and C (< 2 min)")
    parser.add_argument("--refresh", action="store_true", help="re-profile even when cached")
    parser.add_argument(
        "--resolution",
        choices=("imagenet", "uniform"),
        default="imagenet",
        help="how image-model profiles are scaled to 224 px (module docstring)",
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Config()
    cfg = Config(**{**base.__dict__, "resolution": args.resolution})
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    command = " ".join(["python -m tests.bench.bench_simulation", *(argv or sys.argv[1:])])
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(cfg, args.out, args.refresh)
    except AsteroidError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    names = planner_names()
    print_table(rows, names)
    write_markdown(args.out / "simulation.md", rows, names, command, cfg)
    write_csv(args.out / "simulation.csv", rows)
    write_plot(args.out / "simulation.png", rows, names)
    print(f"wrote {args.out}/simulation.{{md,csv,png}} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
