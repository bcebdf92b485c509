"""`asteroid plan`: look at a plan before training with it.

Turns profiles and a cluster spec into a plan with any planner, prints it
next to the simulator's verdict, and can draw the simulated schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import ValidationError
from rich.table import Table

from common.errors import ConfigError, PlanError, StoreError
from common.exit_codes import ExitCode
from common.plan import Plan
from common.profile import ClusterSpec, Profile, load_profiles
from common.settings import CommonSettings
from common.store import Store
from services.cli.console import CliConsole, shown
from services.planner.base import check_memory
from services.planner.cost import CostModel
from services.planner.registry import PLANNERS, get_planner
from services.planner.simulator import SimResult, simulate

__all__ = ["plan", "plan_table"]

console = CliConsole()
GiB = 1 << 30


def _load_cluster(path: Path) -> ClusterSpec:
    try:
        return ClusterSpec.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"cluster {path} is invalid: {exc}") from exc


def _profiles(files: list[Path], cluster: ClusterSpec) -> dict[str, Profile]:
    """Profiles from files (keyed by file stem), else from Redis by the cluster's keys."""
    if files:
        out = {}
        for f in files:
            try:
                out[f.stem] = Profile.model_validate(json.loads(f.read_text()))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"profile {f} is invalid: {exc}") from exc
        return out
    settings = CommonSettings()
    store = Store(settings.redis_url, settings.cluster)
    try:
        store.ping()
        return load_profiles(store, sorted({d.profile for d in cluster.devices}))
    finally:
        store.close()


def plan_table(plan: Plan, sim: SimResult, cost: CostModel) -> Table:
    """Each device's stage, layers, share, K_p and simulated peak memory against its budget."""
    table = Table(
        title=f"{plan.planner} plan: {plan.global_batch} samples, {plan.microbatches} micro-batches"
    )
    for col in ("stage", "layers", "device", "samples/mb", "K", "peak mem", "budget"):
        table.add_column(col)
    for s, stage in enumerate(plan.stages):
        for dev, (lo, hi) in plan.ranges(s).items():
            budget = cost.cluster.device(dev).memory_bytes
            peak = sim.peak_bytes.get(dev, 0)
            mark = "" if peak <= budget else " [red]over[/red]"
            table.add_row(
                str(s),
                f"[{stage.start}, {stage.end})",
                dev,
                str(hi - lo),
                str(plan.warmup(s)),
                f"{peak / GiB:.2f} GiB{mark}",
                f"{budget / GiB:.2f} GiB",
            )
    return table


def plan(
    cluster: Annotated[Path, typer.Option(help="Cluster spec (YAML): devices, memory, links.")],
    global_batch: Annotated[int, typer.Option(help="Samples per round.")],
    microbatches: Annotated[int, typer.Option(help="Micro-batches per round.")],
    planner: Annotated[str, typer.Option(help=f"One of: {', '.join(sorted(PLANNERS))}.")] = (
        "asteroid"
    ),
    profile: Annotated[
        list[Path] | None, typer.Option(help="Profile JSON files (default: from Redis).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the plan as JSON.")] = None,
    timeline: Annotated[
        Path | None, typer.Option(help="Draw the simulated schedule as a PNG.")
    ] = None,
    compare: Annotated[bool, typer.Option(help="Also simulate every other planner.")] = False,
) -> None:
    """Make a plan from profiles and a cluster spec, and simulate it."""
    try:
        spec = _load_cluster(cluster)
        cost = CostModel(_profiles(profile or [], spec), spec)
        made = get_planner(planner).plan(cost, global_batch, microbatches)
    except (ConfigError, PlanError) as exc:
        console.print(f"[red]error:[/red] {shown(exc)}")
        raise typer.Exit(ExitCode.CONFIG) from exc
    except StoreError as exc:
        console.print(f"[red]error:[/red] {shown(exc)}")
        raise typer.Exit(ExitCode.FAILED) from exc
    sim = simulate(made, cost)
    console.print(plan_table(made, sim, cost))
    console.print(
        f"simulated round {sim.round_s * 1000:.1f} ms, {sim.throughput:.1f} samples/s, "
        f"bubbles {sim.bubble_fraction:.0%}; estimate {made.predicted_round_s or 0:.3f} s"
    )
    if compare:
        _compare(cost, global_batch, microbatches)
    if out:
        out.write_text(made.model_dump_json(indent=2))
        console.print(f"plan written to {out}")
    if timeline:
        from services.planner.timeline import draw_timeline

        draw_timeline(sim, made, timeline, title=f"{planner}: {sim.round_s * 1000:.0f} ms/round")
        console.print(f"timeline written to {timeline}")


def _compare(cost: CostModel, global_batch: int, microbatches: int) -> None:
    table = Table(title="planners side by side (simulated)")
    for col in ("planner", "stages", "round ms", "samples/s", "fits memory"):
        table.add_column(col)
    for name in sorted(PLANNERS):
        try:
            p = get_planner(name).plan(cost, global_batch, microbatches)
        except (ConfigError, PlanError) as exc:
            table.add_row(name, "-", "-", "-", f"no plan: {str(exc)[:50]}")
            continue
        sim = simulate(p, cost)
        over = check_memory(p, cost)
        table.add_row(
            name,
            str(len(p.stages)),
            f"{sim.round_s * 1000:.1f}",
            f"{sim.throughput:.1f}",
            "yes" if not over else f"[red]no[/red] ({over[0]})",
        )
    console.print(table)
