"""Galaxy serving on the emulated edge testbed: galaxy, megatron, sp, local and auto, side by side.

    python -m tests.bench.bench_galaxy [--out DIR] [--envs galaxy-a,...] [--models ...]
        [--layers bert_small=4,distilbert=6,gpt2=6] [--requests N] [--sweep-env E]
        [--sweep-model M] [--links 50,125,...] [--memory-env E] [--memory-model M]
        [--memory-layers L] [--deadline HH:MM]   (root; make bench-galaxy)
    python -m tests.bench.bench_galaxy --out DIR --replot   (outputs again from DIR)

Per Galaxy preset (Table III: Nano-L/M/S CPU quotas and memory, 125 Mbit/s
links) a testbed comes up with the real services, and per model and mode one
serving job runs: `ServeModel`, one warm-up request and `--requests` timed ones
of 284 tokens, then its cancel. A plan that does not fit the budgets the
workers report is not run but marked OOM, as the paper marks them. Beside each
latency is the cost model's prediction for the plan the coordinator ran, from
the host's block profile scaled by each device's CPU quota. On `--sweep-env` the
links are re-shaped in place to each of `--links` for galaxy (overlap on and
off), megatron, sp, local and auto; on `--memory-env` a model too big for one
device is planned (and the plans that fit run). Algorithm 1's planning time is
measured for 4 devices. Outputs: DIR/results.md, DIR/results.json,
DIR/latency.png, DIR/sweep.png.

`auto` is the coordinator's own choice of mode and devices (one device
included) by the cost model, from the profiles the devices send (their ring
step cost included) and the link: its rate, and its fixed cost per ring step,
fitted on each testbed to the splits measured before (`fitted_step_latency`).
Every cell is also predicted from the devices' profiles with the testbed's
final fitted value, so predicted / measured shows how well one number per
testbed explains all its cells.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from common.errors import AsteroidError, ConfigError
from common.galaxy.profile import BlockProfile
from common.store import Store
from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec, cluster_spec, preset
from tests.bench.bench_recovery import _on_term, header_lines, keyed_services
from tests.bench.deadline import deadline_check
from tests.bench.galaxy_cells import (
    MODELS,
    Cell,
    compute_scale,
    device_profiles,
    fitted_step_latency,
    host_profile,
    planning_time_s,
    repredict,
    shape,
)
from tests.bench.galaxy_report import tables, write_charts
from tests.bench.galaxy_serve import fresh_workers, serve_cell, set_link

SUBNET = "10.81.0.0/24"
"""No other testbed bench's subnet: they may share a machine."""
GRID_MODES = ("galaxy", "megatron", "sp", "local", "auto")
SWEEP_MODES = ("galaxy", "galaxy-no-overlap", "megatron", "sp", "local", "auto")
MEMORY_MODES = ("galaxy", "megatron", "sp", "local", "auto")
BIG_HIDDEN = 768
"""From this width on every job gets new workers: a worker keeps the last job's weights
while it loads the next and its heap does not shrink, which a 768-wide model's load
pushes past a Nano's memory limit (OOM kills seen on Galaxy-D)."""


def parse_layers(text: str) -> dict[str, int]:
    """`bert_small=4,gpt2=6` -> layers per model; models not named serve all their layers.

    Raises:
        ConfigError: An unknown model or a count that is not a positive integer.

    """
    layers = {name: size.layers for name, size in MODELS.items()}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = item.partition("=")
        if name not in MODELS or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--layers wants MODEL=N with MODEL in {list(MODELS)}, got {item!r}")
        layers[name] = int(count)
    return layers


class Results:
    """What the run has measured so far, saved after every cell (a stopped run keeps it)."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.out, self.header = out, header
        self.cells: list[Cell] = []
        self.planning: list[dict[str, Any]] = []
        self.profiles: dict[str, BlockProfile] = {}

    def add(self, cell: Cell) -> None:
        self.cells.append(cell)
        self.save()

    def save(self) -> None:
        data = {
            **self.header,
            "planning": self.planning,
            "host_profiles": {m: p.model_dump(mode="json") for m, p in self.profiles.items()},
            "cells": [asdict(c) for c in self.cells],
        }
        (self.out / "results.json").write_text(json.dumps(data, indent=1))


def load(out: Path) -> tuple[dict[str, Any], list[Cell], list[dict[str, Any]]]:
    """A results.json: its header fields, its cells and its planning times."""
    data = json.loads((out / "results.json").read_text())
    return data, [Cell(**c) for c in data["cells"]], list(data["planning"])


def write_outputs(out: Path, saved: dict[str, Any], cells: Sequence[Cell], planning: Any) -> None:
    """results.md and the charts, from what was measured (also --replot)."""
    spec = preset(str(saved.get("envs", ["galaxy-a"])[0]), "125mbit")
    head = header_lines(
        "Galaxy serving on the emulated edge testbed", saved["command"], saved["load"], spec
    )
    head = [line for line in head if not line.startswith("- testbed")]
    head += [
        f"- testbeds: {', '.join(saved['envs'])} (Galaxy Table III presets); links "
        f"{saved['link']}; devices: " + "; ".join(saved["devices"]),
        "- latency: median of the requests after one warm-up, ms, as the coordinator "
        "measures it (send to the devices until the answer); in brackets the cost model's "
        "prediction for the plan the coordinator ran, from this machine's one-thread block "
        "profile scaled by 1 / each device's CPU quota",
        "- OOM: the mode's plan does not fit the budgets the workers report "
        "(`services.coordinator.galaxy.planner.fits`; for galaxy and local: no plan fits); not run",
        f"- models: {saved['models']}; 284-token requests, vocab {saved['vocab']}",
        f"- cut: {saved['cut']}",
        "",
    ]
    (out / "results.md").write_text("\n".join([*head, *tables(cells, planning)]) + "\n")
    write_charts(out, cells)


def planning_rows(results: Results, link: str) -> None:
    """Algorithm 1's time over 4 devices (Galaxy-C, and a mixed Nano-L/M/M/S ring)."""
    homog = preset("galaxy-c", link)
    mixed = preset("galaxy-f", link)
    extra = mixed.device("nano-m-0").model_copy(update={"name": "nano-m-1"})
    rings = {
        "galaxy-c: 4 Nano-M": homog,
        "Nano-L, 2 Nano-M, Nano-S": mixed.model_copy(
            update={"devices": [*mixed.devices, extra], "subnet": SUBNET}
        ),
    }
    for label, spec in rings.items():
        cpus = {d.name: d.cpu for d in spec.devices}
        budgets = _budgets(spec)
        for model, host in results.profiles.items():
            config = shape(model, MODELS[model].layers).config()
            seconds = planning_time_s(config, device_profiles(host, cpus), budgets)
            results.planning.append({"devices": label, "model": model, "seconds": seconds})
    results.save()


def _budgets(spec: TestbedSpec) -> dict[str, int]:
    """What each worker reports as its memory budget: the limit less an idle worker."""
    planned = cluster_spec(spec)
    return {d.name: planned.device(d.name).memory_bytes for d in spec.devices}


def _scales(cells: Sequence[Cell]) -> dict[str, float]:
    """Per model, the median compute scale of its measured one-device cells."""
    got: dict[str, list[float]] = {}
    for c in cells:
        if c.mode != "auto" and (k := compute_scale(c)) is not None:
            got.setdefault(c.model, []).append(k)
    return {m: statistics.median(v) for m, v in got.items()}


def env_step_latency(cells: Sequence[Cell]) -> float | None:
    """The link's fixed seconds per ring step on one testbed: the median over its splits.

    Each measured split (auto's aside) gives the latency that would have predicted
    it, with compute corrected by its model's one-device cells; None before any.
    """
    scales = _scales(cells)
    fits = [
        f
        for c in cells
        if c.mode != "auto" and (f := fitted_step_latency(c, scales.get(c.model, 1.0))) is not None
    ]
    return statistics.median(fits) if fits else None


def run_env(
    env: str,
    args: argparse.Namespace,
    results: Results,
    layers: dict[str, int],
    stop: threading.Event,
    past: Callable[[], bool],
) -> None:
    """Bring up one Galaxy preset, serve its cells, take it down (also on errors)."""
    link = float(args.link.removesuffix("mbit"))
    spec = preset(env, args.link).model_copy(update={"subnet": SUBNET})
    cpus = {d.name: d.cpu for d in spec.devices}
    budgets = _budgets(spec)
    todo: list[Cell] = [
        Cell("grid", env, m, layers[m], mode, link) for m in args.models for mode in GRID_MODES
    ]
    if env == args.sweep_env:
        todo += [
            Cell("sweep", env, args.sweep_model, layers[args.sweep_model], mode, float(x))
            for x in args.links
            for mode in SWEEP_MODES
        ]
    if env == args.memory_env:
        todo += [
            Cell("memory", env, args.memory_model, args.memory_layers, mode, link)
            for mode in MEMORY_MODES
        ]
    if past():
        for cell in todo:
            cell.note = "not run: past the deadline"
            results.add(cell)
        return
    logs = args.out / "logs" / env
    shutil.rmtree(logs, ignore_errors=True)
    t0 = time.monotonic()
    with Testbed(spec, logs, stop=stop) as bed:
        bed.up(services=False)
        keyed_services(bed)
        print(f"{env}: testbed up [{time.monotonic() - t0:.0f} s]", flush=True)
        store = Store(bed.redis_url, bed.cluster)
        current = link
        served: tuple[str, int] | None = None
        try:
            for cell in todo:
                if past():
                    cell.note = "not run: past the deadline"
                    results.add(cell)
                    continue
                if cell.link_mbit != current:
                    set_link(bed, cell.link_mbit * 1e6)
                    current = cell.link_mbit
                profiles = device_profiles(results.profiles[cell.model], cpus)
                t1 = time.monotonic()
                big = MODELS[cell.model].hidden >= BIG_HIDDEN
                if served and (big or (cell.model, cell.layers) != served):
                    fresh_workers(bed, store)
                served = (cell.model, cell.layers)
                latency = env_step_latency([c for c in results.cells if c.env == env])
                serve_cell(bed, store, cell, profiles, budgets, args.requests, stop, latency)
                if cell.state == "failed" and not stop.is_set():
                    first = cell.note.strip()
                    fresh_workers(bed, store)
                    cell = replace(cell, state="skipped", latencies_s=[], note="")
                    serve_cell(bed, store, cell, profiles, budgets, args.requests, stop, latency)
                    cell.note = f"retried on new workers after: {first}; {cell.note}"
                results.add(cell)
                print(
                    f"  {cell.part} {cell.model}({cell.layers}) {cell.mode} {cell.link_mbit:g}M: "
                    f"{cell.state} median {cell.median_s} pred {cell.predicted_s} "
                    f"{cell.note[:120]} [{time.monotonic() - t1:.0f} s]",
                    flush=True,
                )
        finally:
            store.close()
        # every cell of the env predicted again with the env's fitted figures
        here = [c for c in results.cells if c.env == env]
        latency, scales = env_step_latency(here), _scales(here)
        for done in here:
            repredict(done, latency or 0.0, scales.get(done.model, 1.0))
        results.save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/galaxy"))
    envs = "galaxy-a,galaxy-b,galaxy-c,galaxy-d,galaxy-e,galaxy-f"
    parser.add_argument("--envs", default=envs, help="Galaxy presets, in order")
    parser.add_argument(
        "--models",
        default="bert_small",
        help=f"models of the grid, of {','.join(MODELS)} (768-wide ones need fresh workers "
        "per job: about 90 s a cell on this testbed)",
    )
    parser.add_argument("--layers", default="gpt2=6", help="MODEL=N,... (default: all)")
    parser.add_argument("--requests", type=int, default=3, help="timed requests per cell")
    parser.add_argument("--link", default="125mbit", help="every device's link rate")
    parser.add_argument("--sweep-env", default="galaxy-d")
    parser.add_argument("--sweep-model", default="bert_small")
    parser.add_argument("--links", default="50,250,1000", help="sweep rates, Mbit/s")
    parser.add_argument("--memory-env", default="galaxy-d")
    parser.add_argument("--memory-model", default="distilbert")
    parser.add_argument("--memory-layers", type=int, default=9)
    parser.add_argument("--deadline", default="", help="UTC HH:MM: start no cell after it")
    parser.add_argument("--cut", default="", help="what was cut, in words, for the report")
    parser.add_argument("--replot", action="store_true", help="only redo the outputs")
    args = parser.parse_args(argv)
    if args.replot:
        saved, cells, planning = load(args.out)
        write_outputs(args.out, saved, cells, planning)
        return 0
    args.envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.links = [float(x) for x in args.links.split(",") if x.strip()]
    layers = parse_layers(args.layers)
    if os.geteuid() != 0:
        print("bench-galaxy builds network namespaces and cgroups: run it as root", file=sys.stderr)
        return 2
    past = deadline_check(args.deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    _on_term(stop)
    t0, load_avg = time.monotonic(), [os.getloadavg()[0]]
    command = "python -m tests.bench.bench_galaxy " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    devices = [
        f"{e}: "
        + ", ".join(
            f"{d.name} {d.cpu:g} cores {_budgets(preset(e))[d.name] >> 20} MiB"
            for d in preset(e).devices
        )
        for e in args.envs
    ]
    header: dict[str, Any] = {
        "command": command,
        "load": load_avg,
        "envs": args.envs,
        "link": args.link,
        "devices": devices,
        "models": ", ".join(
            f"{m} {MODELS[m].hidden}/{MODELS[m].heads}/{MODELS[m].ffn}" for m in MODELS
        ),
        "vocab": 1000,
        "cut": args.cut or "nothing",
    }
    results = Results(args.out, header)
    wanted = {*args.models, args.sweep_model, args.memory_model}
    for model in MODELS:
        if model in wanted:
            results.profiles[model] = host_profile(shape(model, 1).config())
    planning_rows(results, args.link)
    for env in args.envs:
        try:
            run_env(env, args, results, layers, stop, past)
        except (AsteroidError, TimeoutError, OSError) as exc:
            print(f"{env} stopped: {exc}", flush=True)
            results.add(Cell("grid", env, "", 0, "galaxy", 0.0, "failed", note=str(exc)))
    load_avg.append(os.getloadavg()[0])
    results.save()
    saved, cells, planning = load(args.out)
    write_outputs(args.out, saved, cells, planning)
    print((args.out / "results.md").read_text())
    print(f"[{time.monotonic() - t0:.0f} s in all]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
