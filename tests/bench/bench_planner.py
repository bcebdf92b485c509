"""Planner benchmark: planning time of every planner on an EfficientNet-B1-sized model.

    python -m tests.bench.bench_planner [--layers 200] [--repeat 3] [--seed 0]

The model (`--layers` layers, seeded synthetic CNN-like costs) runs on six
Jetson-like devices on a 100 Mbps network (tests/planner/fixtures.py). Each
planner plans `--repeat` times, in alternating order; the table gives the
median planning time, the simulated round of its plan and whether the plan
fits every memory budget. The exhaustive planner is skipped (it refuses
instances this large). Times are wall-clock on a shared machine: compare
planners within one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common.errors import PlanError
from services.planner.asteroid import AsteroidPlanner
from services.planner.base import Planner, check_memory
from services.planner.registry import PLANNERS, get_planner
from services.planner.simulator import simulate
from tests.planner.fixtures import effnet_like_cost

SKIP = {"optimal": "exhaustive; refuses more than 5 devices or 10 layers"}
# Asteroid as the paper has it: the program's pick by the estimate, no simulator polish.
PAPER = "asteroid-paper"


def make(name: str) -> Planner:
    if name == PAPER:
        return AsteroidPlanner(shortlist=1, polish_budget=0)
    return get_planner(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()

    names = [n for n in sorted(PLANNERS) if n not in SKIP]
    names.insert(names.index("asteroid") + 1, PAPER)
    times: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, str] = {}
    for r in range(args.repeat):
        for name in names if r % 2 == 0 else reversed(names):
            cost = effnet_like_cost(layers=args.layers, seed=args.seed)  # cold caches
            t0 = time.perf_counter()
            try:
                plan = make(name).plan(cost, args.global_batch, args.microbatches)
            except PlanError as exc:
                times[name].append(time.perf_counter() - t0)
                results[name] = f"no plan: {exc}"
                continue
            times[name].append(time.perf_counter() - t0)
            sim = simulate(plan, cost)
            over = check_memory(plan, cost)
            results[name] = (
                f"{len(plan.stages)} stages, round {sim.round_s:.3f} s, "
                f"{'fits' if not over else 'over: ' + over[0]}"
            )
    print(
        f"# planning time, {args.layers} layers x 6 devices, global batch "
        f"{args.global_batch}, {args.microbatches} micro-batches, median of {args.repeat}"
    )
    print(f"{'planner':<15} {'plan s':>8}  result")
    for name in names:
        print(f"{name:<15} {statistics.median(times[name]):>8.3f}  {results[name]}")
    for name, why in SKIP.items():
        print(f"{name:<15} {'-':>8}  skipped: {why}")


if __name__ == "__main__":
    main()
