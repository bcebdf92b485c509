"""Part 2 of the split-device benchmark: epoch time of plain and split pipelining at depth 4.

Four emulated devices (namespace, shaped 1 Gbit/s link, memory limit, a CPU
quota and a cpuset of this machine's two cores, so that a split device's
lanes are pinned each to its own core) run the same 4-stage plan per model:
Algorithm 1's partition over one device per stage, from a profile measured
here at one thread and scaled by each device's quota. Its workers run one
intra-op thread per core of the device. Variants: plain (no forward_share),
split (each device at its optimal beta, `DuanWuPlanner.betas` clipped) and
planner (the optimal beta only where the split's gain measured inside that
device clears the planner's margin, `tests.bench.duanwu_split_gain`); same
rounds and seed, each `--repeats` times in alternating order. Samples/s come
from the coordinator's round metrics (median round after the first); the
epoch is `EPOCH_SAMPLES`. The simulator's prediction is recorded beside it.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from common.plan import Plan
from common.profile import ClusterSpec, DeviceSpec, Profile
from common.zoo import ModelSpec
from services.planner.base import stage
from services.planner.cost import CostModel
from services.planner.duanwu import (
    DuanWuPlanner,
    StageTerms,
    algorithm1,
    clip_beta,
    split_cost,
)
from tests.bench.async_runs import samples_per_s
from tests.bench.duanwu_split_common import (
    DEVICE_CORES,
    DEVICE_CPU,
    DEVICE_MEMORY,
    DEVICES,
    EPOCH_SAMPLES,
    GLOBAL_BATCH,
    LINK_BPS,
    MODELS,
    SUBNET,
)
from tests.bench.duanwu_split_gain import (
    StageGain,
    decide,
    device_gain,
    gain_cost,
    planner_variant,
    stage_gains,
)


def measure_profile(model: str, registry: dict[str, dict[str, Any]] = MODELS) -> Profile:
    """The model's layers measured here at one thread, at the micro-batch."""
    from services.profiler.layers import profile_model

    cfg = registry[model]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_model(
            ModelSpec.model_validate(cfg["spec"]), [int(cfg["micro"])], repeats=3, warmup=1
        )
    finally:
        torch.set_num_threads(before)


def device_names(count: int = DEVICES) -> list[str]:
    return [f"edge-{i}" for i in range(count)]


def cost_for(
    profile: Profile,
    devices: Sequence[str],
    cpu: float = DEVICE_CPU,
    memory: int = DEVICE_MEMORY,
    link_bps: float = LINK_BPS,
) -> CostModel:
    """The devices as the planner sees them: the one-thread profile slowed by 1 / quota."""
    cluster = ClusterSpec(
        devices=[
            DeviceSpec(name=d, memory_bytes=memory, profile="ref", slowdown=1 / cpu)
            for d in devices
        ],
        bandwidth=link_bps / 8,
        latency_s=1e-3,
    )
    return CostModel({"ref": profile}, cluster)


def pipeline_plan(cost: CostModel, micro: int, global_batch: int = GLOBAL_BATCH) -> Plan:
    """Algorithm 1's partition with one device per stage, in the cluster's order."""
    devs = [d.name for d in cost.cluster.devices]
    microbatches = global_batch // micro
    part = algorithm1(StageTerms(cost, tuple((d,) for d in devs), micro, microbatches))
    if part is None:
        raise RuntimeError(f"no {len(devs)}-stage partition fits the devices' memory")
    stages = [
        stage(lo, hi, [d], [1])
        for (lo, hi), d in zip(zip(part.cuts, part.cuts[1:], strict=False), devs, strict=True)
    ]
    return Plan(stages=stages, global_batch=global_batch, microbatches=microbatches)


def variant(plan: Plan, betas: dict[str, float] | None) -> Plan:
    """`plan` with each device's forward share from `betas` (None: not split)."""
    stages = [
        s.model_copy(
            update={
                "devices": [
                    a.model_copy(
                        update={"forward_share": None if betas is None else betas[a.device]}
                    )
                    for a in s.devices
                ]
            }
        )
        for s in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})


def variants(
    cost: CostModel, plan: Plan, planner: Plan | None = None
) -> dict[str, tuple[Plan, dict[str, float] | None]]:
    """The runs of `plan`, each with the betas it gives its devices (None: none split).

    `planner` is the plan as the planner splits it from measured gains; it is
    left out where it equals plain or split (the same run twice measures nothing new).
    """
    optimal = {d: clip_beta(b) for d, b in DuanWuPlanner.betas(cost, plan).items()}
    out: dict[str, tuple[Plan, dict[str, float] | None]] = {
        "plain": (variant(plan, None), None),
        "split": (variant(plan, optimal), optimal),
    }
    if planner is not None and all(planner != p for p, _ in out.values()):
        shares = {a.device: a.forward_share for s in planner.stages for a in s.devices}
        out["planner"] = (planner, {d: b for d, b in shares.items() if b is not None})
    return out


def simulator_models_split() -> bool:
    """Whether `simulate` scores a plan's forward_share (its source reads the field)."""
    from services.planner import simulator

    return "forward_share" in inspect.getsource(simulator)


def simulated_samples_per_s(plan: Plan, cost: CostModel) -> float | None:
    from services.planner.simulator import simulate

    try:
        return plan.global_batch / simulate(plan, cost).round_s
    except Exception as exc:  # a prediction is a side figure: note it, keep measuring
        print(f"simulator: {exc}", file=sys.stderr)
        return None


def epoch_s(rate: float | None, epoch: int = EPOCH_SAMPLES) -> float | None:
    return None if not rate else epoch / rate


def job_spec(
    model: str, rounds: int, job_id: str, registry: dict[str, dict[str, Any]] = MODELS
) -> dict[str, Any]:
    """The job every variant of `model` runs: same rounds, seed and optimizer."""
    return {
        "job_id": job_id,
        "model": registry[model]["spec"],
        "seed": 1,
        "rounds": rounds,
        "optimizer": {"kind": "sgd", "lr": 0.01},
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    data: dict[str, Any] = plan.model_dump(mode="json", exclude_none=True)
    return data


@dataclass
class EpochRow:
    """One variant of one model's plan in part 2: its runs and their median samples/s."""

    model: str
    variant: str
    betas: dict[str, float] | None
    stages: list[tuple[int, int]]
    samples_per_s: float | None = None
    runs: list[float] = field(default_factory=list)
    """Samples/s of each run (their median is `samples_per_s`)."""
    rounds_s: list[list[float]] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    """This machine's 1-minute load average as each run started."""
    sim_samples_per_s: float | None = None
    wall_s: float = 0.0
    note: str = ""
    threads: dict[str, int] = field(default_factory=dict)
    """Intra-op threads per device where not one per core: plain's best unsplit count."""

    def add(self, rate: float | None, rounds: list[float]) -> None:
        """Record one run."""
        self.rounds_s.append(rounds)
        if rate is not None:
            self.runs.append(rate)
            self.samples_per_s = statistics.median(self.runs)

    @property
    def epoch_s(self) -> float | None:
        return epoch_s(self.samples_per_s)

    @property
    def sim_epoch_s(self) -> float | None:
        return epoch_s(self.sim_samples_per_s)


def model_plans(models: Sequence[str], cpu: float) -> dict[str, tuple[CostModel, Plan]]:
    """Each model's cost model (devices at `cpu` cores) and its depth-4 plan."""
    out = {}
    for model in models:
        cost = cost_for(measure_profile(model), device_names(), cpu=cpu)
        out[model] = (cost, pipeline_plan(cost, int(MODELS[model]["micro"])))
    return out


def plan_rows(
    plans: dict[str, tuple[CostModel, Plan]], planner: dict[str, Plan] | None = None
) -> list[tuple[EpochRow, Plan]]:
    """Every epoch run (model by model, the variants of one plan), not yet run."""
    out = []
    sim = simulator_models_split()
    for model, (cost, plan) in plans.items():
        for name, (p, betas) in variants(cost, plan, (planner or {}).get(model)).items():
            row = EpochRow(model, name, betas, [(s.start, s.end) for s in p.stages])
            if sim or betas is None:  # a splitting device at its measured speed, if any
                row.sim_samples_per_s = simulated_samples_per_s(p, split_cost(cost, p))
            out.append((row, p))
    return out


def run_order(todo: Sequence[tuple[EpochRow, Plan]], repeats: int) -> list[tuple[EpochRow, Plan]]:
    """Model by model, its variants `repeats` times, every other pass reversed (drift cancels)."""
    out: list[tuple[EpochRow, Plan]] = []
    for model in dict.fromkeys(r.model for r, _ in todo):
        mine = [t for t in todo if t[0].model == model]
        for k in range(repeats):
            out += mine if k % 2 == 0 else mine[::-1]
    return out


def plain_threads(gains: Sequence[StageGain], cpu: float, cores: int) -> dict[str, int]:
    """Per device, the intra-op threads an unsplit worker runs fastest with.

    What the in-device measurement found (`best_threads`: one per core or one,
    whichever ran the pair in turn faster); unmeasured, one thread where the
    CPU quota is below the core count (threads there spin and burn the quota),
    else one per core. Plain is then the best unsplit worker, not a slow one.
    """
    fallback = 1 if cpu < cores else cores
    out = {}
    for g in gains:
        m = g.on_device
        out[g.device] = int(m.get("best_threads", fallback)) if m else fallback
    return out


class EpochBench:
    """The four emulated devices, a Redis on the bridge, one coordinator per run."""

    def __init__(
        self, out: Path, rounds: int, cpu: float = DEVICE_CPU, cores: str | None = DEVICE_CORES
    ) -> None:
        from services.testbed.spec import TestbedDevice, TestbedSpec, parse_cpus

        self.out, self.rounds, self.cpu = out, rounds, cpu
        self.choices: dict[str, str] = {}
        """Per model: what the planner's rule chose from the gains measured in the devices."""
        self.threads = 1 if cores is None else len(parse_cpus(cores))
        """Intra-op threads of a splitting worker: one per core of its device."""
        self.spec = TestbedSpec(
            name="duanwu-split",
            subnet=SUBNET,
            devices=[
                TestbedDevice(
                    name=d,
                    kind="homogeneous",
                    cpu=cpu,
                    cpus=cores,
                    memory_bytes=DEVICE_MEMORY,
                    bandwidth_bps=LINK_BPS,
                )
                for d in device_names()
            ],
        )

    def run(
        self,
        plans: dict[str, tuple[CostModel, Plan]],
        past: Callable[[], bool],
        repeats: int = 1,
        gain_repeats: int = 15,
        written: Callable[[list[StageGain], list[EpochRow]], None] | None = None,
    ) -> tuple[list[StageGain], list[EpochRow]]:
        """Gains inside each device, then each model's variants `repeats` times (ABC CBA ...).

        `written` is called with what is known so far before the epoch runs start
        (the gains are kept if the runs fail).
        """
        from common.curve import create_key_set
        from common.embedded_redis import EmbeddedRedis
        from services.testbed.bed import Testbed

        logs = self.out / "logs"
        gains: list[StageGain] = []
        with Testbed(self.spec, logs / "testbed") as bed:
            bed.up(services=False)
            planner: dict[str, Plan] = {}
            scored: dict[str, tuple[CostModel, Plan]] = {}
            for model, (cost, plan) in plans.items():
                rows = stage_gains(model, plan)
                for r in rows:
                    device_gain(bed, r, gain_repeats)
                decide(cost, plan, rows, "device")
                planner[model], self.choices[model] = planner_variant(cost, plan, rows)
                scored[model] = (gain_cost(cost, {r.device: r.gain("device") for r in rows}), plan)
                gains += rows
            todo = plan_rows(scored, planner)
            for row, _ in todo:
                if row.betas is None:  # plain: each device at its best unsplit thread count
                    row.threads = plain_threads(
                        [g for g in gains if g.model == row.model], self.cpu, self.threads
                    )
            epochs = [r for r, _ in todo]
            if written is not None:
                written(gains, epochs)
            keys = logs / "keys"
            create_key_set(keys, bed.devices)
            with EmbeddedRedis(host=bed.bridge) as redis:
                for i, (row, plan) in enumerate(run_order(todo, repeats)):
                    if past():
                        row.note = "past the deadline: fewer runs"
                        continue
                    t0 = time.monotonic()
                    row.loads.append(round(os.getloadavg()[0], 2))
                    self.one(bed, redis.url, keys, i, row, plan)
                    row.wall_s += time.monotonic() - t0
                    print(
                        f"epoch {row.model} {row.variant}: {row.runs[-1] if row.runs else 0:.2f} "
                        f"samples/s (sim {row.sim_samples_per_s or 0:.2f}) {row.note} "
                        f"[{time.monotonic() - t0:.0f} s]",
                        flush=True,
                    )
        return gains, epochs

    def one(self, bed: Any, redis_url: str, keys: Path, i: int, row: EpochRow, plan: Plan) -> None:
        from common.procs import spawn, stop_all
        from common.store import Store
        from services.testbed.bed import _free_port

        label = f"{row.model}-{row.variant}"
        logs = self.out / "logs" / label
        logs.mkdir(parents=True, exist_ok=True)
        coordinator = f"tcp://{bed.bridge}:{_free_port(bed.bridge)}"
        cluster = f"dws-{os.getpid()}-{i}"
        env = {
            "ASTEROID_REDIS_URL": redis_url,
            "ASTEROID_CLUSTER": cluster,
            "ASTEROID_COORDINATOR": coordinator,
            "ASTEROID_KEYS": str(keys),
            "ASTEROID_HEARTBEAT_S": "0.5",
            "ASTEROID_LOG_FORMAT": "json",
        }

        def pairs(dev: str) -> list[str]:
            n = str(row.threads.get(dev, self.threads))
            mine = {**env, "ASTEROID_THREADS": n, "OMP_NUM_THREADS": n}
            return [f"{k}={v}" for k, v in mine.items()]

        procs = []
        job_id = "split"
        (logs / "job.yaml").write_text(yaml.safe_dump(job_spec(row.model, self.rounds, job_id)))
        (logs / "plan.json").write_text(json.dumps(plan_json(plan)))
        try:
            for dev in bed.devices:
                worker = [sys.executable, "-m", "services.worker.main", "--device", dev]
                procs.append(bed.start(dev, f"{label}/{dev}.worker", ["env", *pairs(dev), *worker]))
            cmd = [sys.executable, "-m", "services.coordinator.main", "--bind", coordinator]
            cmd += ["--shutdown-workers", "--job", str(logs / "job.yaml")]
            cmd += ["--plan", str(logs / "plan.json")]
            coord = spawn(cmd, {**os.environ, **env}, logs / "coordinator.log")
            procs.append(coord)
            try:
                code = coord.wait(timeout=900)
            except Exception:
                code = None
            if code != 0:
                row.note = f"coordinator exit {code} (see logs/{label})"
            store = Store(redis_url, cluster)
            try:
                metrics = store.read("metrics", job_id)
            finally:
                store.close()
            row.add(*samples_per_s(metrics, plan.global_batch))
        finally:
            stop_all(procs, timeout_s=10.0)
