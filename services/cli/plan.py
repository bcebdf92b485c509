"""`asteroid plan`: look at a plan before training with it.

Turns a cluster file a person writes (devices named by a profile: a shipped
device kind, `here`, or a fingerprint in Redis; see `plan_profiles`) into a plan
with any planner, prints it next to the simulator's verdict, and can draw the
simulated schedule. The planners, the simulator and the store load when a plan
is made: every `asteroid` start imports this module to register the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from common.errors import ConfigError, StoreError
from common.exit_codes import ExitCode
from services.cli.console import CliConsole
from services.cli.failure import fail
from services.cli.jobs import RedisOpt

if TYPE_CHECKING:
    from common.plan import Plan
    from common.profile import ClusterSpec, Profile
    from common.store import Store
    from common.zoo import ModelSpec
    from services.planner.cost import CostModel
    from services.planner.simulator import SimResult

__all__ = ["PLANNER_NAMES", "plan", "plan_table"]

console = CliConsole()
GiB = 1 << 30
PLANNER_NAMES = ("asteroid", "dapple", "dp", "duanwu", "gpipe", "hetpipe", "optimal", "pipedream")
"""`services.planner.registry.PLANNERS`'s names, sorted, for `--help` without loading the planners.

A test holds the two equal.
"""


def _load_cluster(path: Path) -> ClusterSpec:
    """The cluster file: one line naming a bad field, an unknown key with the closest one."""
    from common.profile import ClusterSpec
    from common.spec_files import load_spec_file

    return load_spec_file(path, ClusterSpec, "cluster")


def _open_store(redis_url: str | None) -> Store | StoreError:
    """A Store on the cluster's Redis when one answers within seconds, else why not.

    Where: the option, else ASTEROID_*, else the running local cluster. Only stored
    profiles need it, so a Redis that does not answer means: none listed (and a
    name found nowhere else says so, see `_profiles`).
    """
    from common.local_cluster import resolve_settings
    from common.store import Store

    try:
        settings = resolve_settings(redis_url=redis_url)
    except ConfigError as exc:
        return StoreError(str(exc))
    store = Store(settings.redis_url, settings.cluster, timeout_s=5.0, connect_timeout_s=2.0)
    try:
        store.ping()
    except StoreError as exc:
        store.close()
        return exc
    return store


def _model(name: str) -> ModelSpec:
    from pydantic import ValidationError

    from common.zoo import ModelSpec  # torch comes with the zoo: not for --help

    try:
        return ModelSpec(name=name)
    except ValidationError as exc:
        raise ConfigError(f"--model {name!r} is not a model: {exc}") from exc


def _from_files(files: list[Path]) -> dict[str, Profile]:
    """Profiles from JSON files, keyed by file stem (a device's `profile:` names a stem)."""
    from common.profile import Profile

    out = {}
    for f in files:
        try:
            out[f.stem] = Profile.model_validate(json.loads(f.read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"profile {f} is invalid: {exc}") from exc
    return out


def _profiles(
    cluster: ClusterSpec, model: str, micro: int, redis_url: str | None
) -> dict[str, Profile]:
    """Each profile name the cluster's devices give, resolved (see `plan_profiles`)."""
    # the testbed's device kinds come with the testbed package: only for a plan
    from services.cli.plan_profiles import (
        HERE,
        KINDS,
        UnknownProfile,
        known_names,
        resolve_profiles,
    )

    wanted: dict[str, str] = {}
    for d in cluster.devices:
        if not d.profile:
            names = ", ".join(p.name for p in known_names())
            raise ConfigError(f"device {d.name} names no profile; give one of: {names}")
        wanted.setdefault(d.profile, d.name)
    spec = _model(model)
    opened: Store | StoreError | None = None
    if any(name not in KINDS and name != HERE for name in wanted):
        opened = _open_store(redis_url)
    store = None if isinstance(opened, StoreError) else opened
    try:
        return resolve_profiles(wanted, spec, micro, store)
    except UnknownProfile as exc:
        if not isinstance(opened, StoreError) or exc.close:
            raise  # a typo of a known name, or Redis was read: the name is wrong
        raise StoreError(f"{exc}; and {opened}, so profiles stored there were not read") from exc
    finally:
        if store is not None:
            store.close()


def _list_profiles(model: str, redis_url: str | None) -> None:
    """Print every profile name a cluster file may use for `model`."""
    from common.model_key import model_key
    from services.cli.plan_profiles import known_names, stored_fingerprints

    key = model_key(_model(model))
    opened = _open_store(redis_url)
    store = None if isinstance(opened, StoreError) else opened
    stored = [] if store is None else stored_fingerprints(store, key)
    if store is not None:
        store.close()
    table = Table(title=f"profiles for {key}")
    for col in ("profile", "memory", "what"):
        table.add_column(col)
    for p in known_names(stored):
        table.add_row(p.name, f"{p.memory_bytes / GiB:.1f} GiB" if p.memory_bytes else "", p.what)
    console.print(table)
    if store is None:
        console.print("no Redis answered: profiles stored by asteroid-profiler are not listed")


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
    cluster: Annotated[
        Path | None,
        typer.Option(help="Cluster file (YAML): devices with a profile and memory; links."),
    ] = None,
    global_batch: Annotated[int | None, typer.Option(min=1, help="Samples per round.")] = None,
    microbatches: Annotated[
        int | None, typer.Option(min=1, help="Micro-batches per round.")
    ] = None,
    model: Annotated[
        str, typer.Option(help="Zoo model the devices' profiles describe.")
    ] = "small_cnn",
    planner: Annotated[str, typer.Option(help=f"One of: {', '.join(PLANNER_NAMES)}.")] = (
        "asteroid"
    ),
    profile: Annotated[
        list[Path] | None,
        typer.Option(help="Profile JSON files, named by stem (instead of profile names)."),
    ] = None,
    list_profiles: Annotated[
        bool, typer.Option("--list-profiles", help="List the profile names a device may give.")
    ] = False,
    out: Annotated[Path | None, typer.Option(help="Write the plan as JSON.")] = None,
    timeline: Annotated[
        Path | None, typer.Option(help="Draw the simulated schedule as a PNG.")
    ] = None,
    compare: Annotated[bool, typer.Option(help="Also simulate every other planner.")] = False,
    redis_url: RedisOpt = None,
) -> None:
    """Make a plan from a cluster file, and simulate it.

    Each device's `profile:` is a device kind, `here` (this machine, measured now)
    or a fingerprint profiled into Redis: `asteroid plan --list-profiles` lists them.
    """
    from common.errors import PlanError
    from services.planner.cost import CostModel
    from services.planner.registry import get_planner
    from services.planner.simulator import simulate

    try:
        if list_profiles:
            _list_profiles(model, redis_url)
            return
        if cluster is None or global_batch is None or microbatches is None:
            raise ConfigError(
                "give --cluster, --global-batch and --microbatches "
                "(asteroid examples writes a cluster.yaml to start from)"
            )
        chosen = get_planner(planner)  # a bad name is refused before profiles are looked up
        spec = _load_cluster(cluster)
        micro = -(-global_batch // microbatches)
        profiles = _from_files(profile) if profile else _profiles(spec, model, micro, redis_url)
        cost = CostModel(profiles, spec)
        made = chosen.plan(cost, global_batch, microbatches)
    except (ConfigError, PlanError) as exc:
        raise fail(exc, ExitCode.CONFIG) from exc  # one line on stderr
    except StoreError as exc:
        raise fail(exc, ExitCode.UNREACHABLE) from exc
    sim = simulate(made, cost)
    console.print(plan_table(made, sim, cost))
    console.print(
        f"simulated round {sim.round_s * 1000:.1f} ms, {sim.throughput:.1f} samples/s, "
        f"bubbles {sim.bubble_fraction:.0%}; estimate {made.predicted_round_s or 0:.3f} s"
    )
    _async_prediction(made, cost)
    if compare:
        _compare(cost, global_batch, microbatches)
    if out:
        out.write_text(made.model_dump_json(indent=2))
        console.print(f"plan written to {out}")
    if timeline:
        from services.planner.timeline import draw_timeline

        draw_timeline(sim, made, timeline, title=f"{planner}: {sim.round_s * 1000:.0f} ms/round")
        console.print(f"timeline written to {timeline}")


def _async_prediction(plan: Plan, cost: CostModel) -> None:
    """What mode async without a drain would gain on this plan, if it can run async.

    The profiles time forwards and backwards only, not an optimizer step or a
    weight snapshot per micro-batch, so this is async's best case: where it does
    not pay even then, keep sync.
    """
    from common.errors import PlanError
    from services.planner.async_gain import predict_plan

    free = [0.0] * len(plan.stages)
    try:
        gain = predict_plan(plan, cost, free, free)
    except PlanError:
        return  # groups or split devices: sync only
    console.print(f"mode async, no drain, updates not profiled (its best case): {gain.describe()}")


def _compare(cost: CostModel, global_batch: int, microbatches: int) -> None:
    from common.errors import PlanError
    from services.planner.base import check_memory
    from services.planner.registry import PLANNERS, get_planner
    from services.planner.simulator import simulate

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
