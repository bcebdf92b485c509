"""Duan & Wu benchmark: Algorithm 2 against brute force; the beta split against plain pipelines.

    python -m tests.bench.bench_duanwu --out bench-results/duanwu [--quick] [--seed 0]

(a) The shape of the paper's Fig. 7: random sets of 4-6 devices drawn from three
device types are grouped into a depth-4 pipeline by Algorithm 2 (its greedy start
alone, and after local search), by the paper's sorting baseline, and by brute force
over every ordered grouping; the table gives Algorithm 1's bound (the longest
per-micro-batch operation, which paces the steady state) relative to brute force,
and the planning time. (b) The paper's Fig. 5 comparison at depth 4 on four
identical devices: one round of M micro-batches with every device splitting its
compute between concurrent forward and backward at the optimal beta, at the paper's
default beta = 1/2, and run plainly (forward and backward in turn, the runtime's
1F1B schedule in the discrete-event simulator). The first two are the paper's
lane model (`concurrent_round`: no in-flight cap, lanes free-running); "worker"
is the same optimal split as the workers run it (`simulate` with the plan's
forward shares: K_p bounds the forwards, a device starts a backward and a
forward together and joins them before its next decision). The models are synthetic profiles
shaped like AlexNet and GoogLeNet (per-layer FLOPs, output sizes and parameters
approximated from the architectures, a laptop-class device at an assumed 1 TFLOP/s).
Every figure is a prediction of the cost model, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from common.plan import Plan
from common.profile import LayerProfile, Profile
from services.planner.base import stage
from services.planner.cost import CostModel
from services.planner.duanwu import (
    DuanWuPlanner,
    StageTerms,
    algorithm1,
    algorithm2,
    brute_force_grouping,
    clip_beta,
    concurrent_round,
    initial_grouping,
)
from services.planner.simulator import simulate
from tests.planner.fixtures import hetero_cost

FLOPS = 1e12  # assumed sustained FLOP/s of the reference (laptop CPU + GTX 1650) device
GIB = 1 << 30
# (name, slowdown against the reference, memory): the paper's three device kinds
DEVICE_TYPES = [("i7-1650", 1.0, 8 * GIB), ("i5-xe", 2.2, 8 * GIB), ("pi4", 9.0, 4 * GIB)]

# name, forward GMACs per sample, backward/forward ratio, output floats, parameters
ALEXNET = [
    ("conv1", 0.105, 1.1, 96 * 27 * 27, 35e3),
    ("conv2", 0.224, 2.0, 256 * 13 * 13, 307e3),
    ("conv3", 0.150, 2.0, 384 * 13 * 13, 885e3),
    ("conv4", 0.112, 2.0, 384 * 13 * 13, 663e3),
    ("conv5", 0.075, 2.0, 256 * 6 * 6, 442e3),
    ("fc6", 0.038, 2.0, 4096, 37.7e6),
    ("fc7", 0.017, 2.0, 4096, 16.8e6),
    ("fc8", 0.004, 2.0, 1000, 4.1e6),
]
GOOGLENET = [
    ("conv1", 0.118, 1.1, 64 * 56 * 56, 9.4e3),
    ("conv2", 0.360, 2.1, 192 * 28 * 28, 0.11e6),
    ("inc3a", 0.128, 2.3, 256 * 28 * 28, 0.16e6),
    ("inc3b", 0.304, 2.3, 480 * 14 * 14, 0.38e6),
    ("inc4a", 0.073, 2.3, 512 * 14 * 14, 0.36e6),
    ("inc4b", 0.088, 2.3, 512 * 14 * 14, 0.44e6),
    ("inc4c", 0.100, 2.3, 512 * 14 * 14, 0.46e6),
    ("inc4d", 0.119, 2.3, 528 * 14 * 14, 0.58e6),
    ("inc4e", 0.170, 2.3, 832 * 7 * 7, 0.84e6),
    ("inc5a", 0.054, 2.3, 832 * 7 * 7, 1.07e6),
    ("inc5b", 0.071, 2.3, 1024 * 7 * 7, 1.39e6),
    ("fc", 0.001, 2.0, 1000, 1.0e6),
]
MODELS = {"alexnet-like": ALEXNET, "googlenet-like": GOOGLENET}
STEADY = 64  # micro-batches after which a round's growth per micro-batch is the period


def model_profile(name: str) -> Profile:
    """A profile of `name` on the reference device: time linear in the batch (the paper's model)."""
    layers = []
    for i, (label, gmacs, ratio, out, params) in enumerate(MODELS[name]):
        fwd = 2 * gmacs * 1e9 / FLOPS
        layers.append(
            LayerProfile(
                index=i,
                name=label,
                forward_s=[fwd],
                backward_s=[fwd * ratio],
                output_bytes=4 * out,
                activation_bytes=8 * out,
                param_bytes=int(4 * params),
                optimizer_bytes=int(4 * params),
            )
        )
    return Profile(model=name, device="reference", batch_sizes=[1], layers=layers)


def sorting_grouping(
    cost: CostModel, devices: list[str], depth: int, micro: int
) -> list[list[str]]:
    """The paper's sorting baseline: slowest first, a group closes once it passes the average."""
    speed = {d: 1 / cost.step(d, 0, cost.num_layers, micro) for d in devices}
    order = sorted(devices, key=lambda d: (speed[d], d))
    target = sum(speed.values()) / depth
    groups: list[list[str]] = [[]]
    for i, d in enumerate(order):
        left = len(order) - i
        full = sum(speed[x] for x in groups[-1]) >= target or left <= depth - len(groups)
        if groups[-1] and full and len(groups) < depth:
            groups.append([])
        groups[-1].append(d)
    return groups


def bound_of(cost: CostModel, groups: list[list[str]], micro: int, m: int) -> float:
    got = algorithm1(StageTerms(cost, tuple(tuple(sorted(g)) for g in groups), micro, m))
    return float("inf") if got is None else got.bound


def fig7(seed: int, sizes: list[int], instances: int, micro: int, m: int) -> list[dict[str, Any]]:
    """Bound ratios and planning times of each grouping method against brute force."""
    rng = random.Random(seed)
    rows = []
    for model in MODELS:
        prof = model_profile(model)
        for n in sizes:
            for k in range(instances):
                kinds = [rng.choice(DEVICE_TYPES) for _ in range(n)]
                devs = [(f"{kind}-{i}", s, mem) for i, (kind, s, mem) in enumerate(kinds)]
                cost = hetero_cost(devs, prof, bandwidth=1.25e8)
                names = [d[0] for d in devs]
                t0 = time.perf_counter()
                alg2 = algorithm2(cost, names, 4, micro, m)
                t_alg2 = time.perf_counter() - t0
                t0 = time.perf_counter()
                brute = brute_force_grouping(cost, names, 4, micro, m)
                t_brute = time.perf_counter() - t0
                if alg2 is None or brute is None:
                    continue
                best = brute.partition.bound
                rows.append(
                    {
                        "model": model,
                        "devices": n,
                        "instance": k,
                        "brute_bound_s": best,
                        "alg2_bound_s": alg2.partition.bound,
                        "initial_bound_s": bound_of(
                            cost, initial_grouping(cost, names, 4, micro), micro, m
                        ),
                        "sorting_bound_s": bound_of(
                            cost, sorting_grouping(cost, names, 4, micro), micro, m
                        ),
                        "alg2_s": t_alg2,
                        "brute_s": t_brute,
                        "alg2_groupings": alg2.evaluated,
                        "brute_groupings": brute.evaluated,
                    }
                )
    return rows


def with_split(plan: Plan, cost: CostModel) -> Plan:
    """`plan` with every device's clipped optimal beta as its forward share."""
    betas = DuanWuPlanner.betas(cost, plan)
    stages = [
        spec.model_copy(
            update={
                "devices": [
                    a.model_copy(update={"forward_share": clip_beta(betas[a.device])})
                    for a in spec.devices
                ]
            }
        )
        for spec in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})


def depth4(micro: int, ms: list[int], bandwidths: list[float]) -> list[dict[str, Any]]:
    """Round times of Algorithm 1's depth-4 partition, with and without the beta split."""
    rows = []
    for model in MODELS:
        prof = model_profile(model)
        for bw in bandwidths:
            devs = [(f"w{i}", 1.0, 8 * GIB) for i in range(4)]
            cost = hetero_cost(devs, prof, bandwidth=bw)
            for m in ms:
                part = algorithm1(StageTerms(cost, (("w0",), ("w1",), ("w2",), ("w3",)), micro, m))
                if part is None:
                    raise SystemExit(f"{model} does not fit four devices")
                specs = [stage(lo, hi, [f"w{p}"], [1]) for p, (lo, hi) in enumerate(part.ranges)]
                plan = Plan(stages=specs, global_batch=micro * m, microbatches=m)
                a, b = (
                    Plan(stages=specs, global_batch=micro * k, microbatches=k)
                    for k in (STEADY, 2 * STEADY)
                )
                rounds = {
                    "beta_opt": [concurrent_round(p, cost) for p in (plan, a, b)],
                    "beta_half": [concurrent_round(p, cost, beta=0.5) for p in (plan, a, b)],
                    "plain_1f1b": [simulate(p, cost).round_s for p in (plan, a, b)],
                    "worker_split": [
                        simulate(with_split(p, cost), cost).round_s for p in (plan, a, b)
                    ],
                }
                row: dict[str, Any] = {
                    "model": model,
                    "bandwidth_Bps": bw,
                    "microbatches": m,
                    "cuts": list(part.cuts),
                    "bound_s": part.bound,
                }
                for mode, (short, steady, longer) in rounds.items():
                    row[f"{mode}_round_s"] = short
                    # steady state: what STEADY more micro-batches add, per micro-batch
                    row[f"{mode}_period_s"] = (longer - steady) / STEADY
                rows.append(row)
    return rows


def pct(new: float, old: float) -> float:
    """How much shorter `new` is than `old`, in percent (negative: longer)."""
    return 100.0 * (old - new) / old


def write_md(out: Path, a: list[dict[str, Any]], b: list[dict[str, Any]], wall: float) -> None:
    lines = [
        "# Duan & Wu planner: predictions of the cost model (not measurements)",
        "",
        f"Wall time {wall:.1f} s.",
        "",
        "## (a) Grouping: bound relative to brute force (depth 4; 1.0 = optimal)",
        "",
        "| model | devices | n | Alg. 2 mean | Alg. 2 max | greedy start mean | sorting mean "
        "| Alg. 2 ms | brute ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["model"], r["devices"]) for r in a})
    for model, n in keys:
        rs = [r for r in a if r["model"] == model and r["devices"] == n]

        def ratio(field: str, rows: list[dict[str, Any]] = rs) -> list[float]:
            return [r[field] / r["brute_bound_s"] for r in rows]

        lines.append(
            f"| {model} | {n} | {len(rs)} | {statistics.mean(ratio('alg2_bound_s')):.4f} "
            f"| {max(ratio('alg2_bound_s')):.4f} | {statistics.mean(ratio('initial_bound_s')):.4f} "
            f"| {statistics.mean(ratio('sorting_bound_s')):.4f} "
            f"| {1e3 * statistics.median(r['alg2_s'] for r in rs):.1f} "
            f"| {1e3 * statistics.median(r['brute_s'] for r in rs):.1f} |"
        )
    lines += [
        "",
        "## (b) Depth 4, four identical devices: one round (s)",
        "",
        "| model | link | M | cuts | beta opt | beta 1/2 | plain 1F1B | vs 1/2 | vs plain "
        "| worker split | worker vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in b:
        lines.append(
            f"| {r['model']} | {r['bandwidth_Bps'] * 8 / 1e9:g} Gbps | {r['microbatches']} "
            f"| {r['cuts']} | {r['beta_opt_round_s']:.4f} | {r['beta_half_round_s']:.4f} "
            f"| {r['plain_1f1b_round_s']:.4f} "
            f"| {pct(r['beta_opt_round_s'], r['beta_half_round_s']):+.1f} % "
            f"| {pct(r['beta_opt_round_s'], r['plain_1f1b_round_s']):+.1f} % "
            f"| {r['worker_split_round_s']:.4f} "
            f"| {pct(r['worker_split_round_s'], r['plain_1f1b_round_s']):+.1f} % |"
        )
    lines += [
        "",
        f"## (b') Steady state: seconds per micro-batch, from rounds of {STEADY} and "
        f"{2 * STEADY} micro-batches",
        "",
        "| model | link | beta opt | beta 1/2 | plain 1F1B | vs 1/2 | vs plain | worker split "
        "| worker vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first_m = min(r["microbatches"] for r in b)
    for r in b:
        if r["microbatches"] != first_m:
            continue  # the period does not depend on the round's M
        lines.append(
            f"| {r['model']} | {r['bandwidth_Bps'] * 8 / 1e9:g} Gbps "
            f"| {r['beta_opt_period_s']:.4f} | {r['beta_half_period_s']:.4f} "
            f"| {r['plain_1f1b_period_s']:.4f} "
            f"| {pct(r['beta_opt_period_s'], r['beta_half_period_s']):+.1f} % "
            f"| {pct(r['beta_opt_period_s'], r['plain_1f1b_period_s']):+.1f} % "
            f"| {r['worker_split_period_s']:.4f} "
            f"| {pct(r['worker_split_period_s'], r['plain_1f1b_period_s']):+.1f} % |"
        )
    lines += ["", "Paper (Fig. 5, depth 4): 5.7 % (AlexNet), 7.3 % (GoogLeNet), measured by", ""]
    lines[-2] += " trace-driven simulation against a pipeline at beta = 1/2."
    (out / "results.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted({r["devices"] for r in a})
    for field, label in [
        ("alg2_bound_s", "Alg. 2"),
        ("initial_bound_s", "greedy start"),
        ("sorting_bound_s", "sorting"),
    ]:
        ys = [
            statistics.mean(r[field] / r["brute_bound_s"] for r in a if r["devices"] == n)
            for n in sizes
        ]
        ax1.plot(sizes, ys, marker="o", label=label)
    ax1.axhline(1.0, color="k", lw=0.8, label="brute force")
    ax1.set_xlabel("devices")
    ax1.set_ylabel("bound / brute-force bound")
    ax1.set_title("(a) grouping, depth 4 (mean over models)")
    ax1.legend()
    labels = [
        f"{r['model'].split('-')[0]}\n{r['bandwidth_Bps'] * 8 / 1e9:g}G M={r['microbatches']}"
        for r in b
    ]
    xs = range(len(b))
    width = 0.27
    for i, (field, label) in enumerate(
        [
            ("beta_opt_round_s", "beta opt"),
            ("beta_half_round_s", "beta 1/2"),
            ("plain_1f1b_round_s", "plain 1F1B"),
        ]
    ):
        base = [r["plain_1f1b_round_s"] for r in b]
        ax2.bar(
            [x + (i - 1) * width for x in xs],
            [r[field] / p for r, p in zip(b, base, strict=True)],
            width,
            label=label,
        )
    ax2.set_xticks(list(xs), labels, fontsize=7)
    ax2.set_ylabel("round / plain 1F1B round")
    ax2.set_title("(b) depth 4: predicted round")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "duanwu.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/duanwu"))
    parser.add_argument("--quick", action="store_true", help="fewer and smaller instances")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sizes, instances = ([4, 5], 2) if args.quick else ([4, 5, 6], 8)
    a = fig7(args.seed, sizes, instances, micro=32, m=4)
    b = depth4(32, [4] if args.quick else [4, 32], [1.25e8, 1.25e9])
    wall = time.perf_counter() - t0
    config = {"seed": args.seed, "quick": args.quick, "flops": FLOPS, "micro": 32, "depth": 4}
    data = {"config": config, "fig7": a, "depth4": b, "wall_s": wall}
    (args.out / "results.json").write_text(json.dumps(data, indent=1))
    write_md(args.out, a, b, wall)
    plot(args.out, a, b)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
