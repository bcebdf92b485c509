"""bench_async's part 2: async against sync on a heterogeneous pipeline, dynamic partition on.

The devices differ about 3x (env-d: a 0.5-core TX2-like device, 0.177-core
Nano-like ones). The plan is made for them as a re-partition would make it:
the model's layers (`HETERO_MODEL`, profiled once on the host) balanced by
each device's speed (the host's times over its CPU quota). The job may adapt
(`services.coordinator.adapt`): the plan's cluster and profile are stored
where the coordinator reads the cluster a job was planned for, so measured
speeds have layer costs to move partition points by. Mid-run the quota of the
device holding the most layers is cut to `HETERO_CUT` of its own (a thermal
throttle; a device with one layer has nothing to give away): both
modes should re-partition, async's new Assign being a drain point of its
stream. Reported: samples/s before the throttle, throttled, after the
re-partition, and every re-partition event.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tests.bench.async_jobs import (
    HETERO_CUT,
    HETERO_DATA,
    HETERO_DEVICES,
    HETERO_MODEL,
    HETERO_WINDOW,
    MICRO,
    cuts_by_speed,
    hetero_configs,
    job_for,
    plan_of,
)
from tests.bench.async_runners import Extras, Throttle
from tests.bench.async_runs import Run, Runner, phases, run_one

PROFILE_KEY_DEVICE = "bench-host"
"""The fingerprint the host's profile is stored under."""


def host_profile(model: Mapping[str, Any] = HETERO_MODEL) -> Any:
    """`model` profiled on this process at the micro-batch size (one thread)."""
    import torch

    from common.zoo import ModelSpec
    from services.profiler.layers import profile_model

    torch.set_num_threads(1)
    spec = ModelSpec.model_validate(dict(model))
    return profile_model(spec, [MICRO], repeats=5, warmup=2, device=PROFILE_KEY_DEVICE)


def extras_for(
    profile: Any,
    cpus: Mapping[str, float],
    memory: Mapping[str, int],
    throttle: Throttle | None,
    devices: Sequence[str] = HETERO_DEVICES,
) -> tuple[Extras, list[int]]:
    """The cluster a plan for these quotas is made for, and that plan's partition points.

    A device's slowdown is one over its quota in cores (the host profile ran on
    one whole core); the points balance the profiled layer costs by speed, stages
    on `devices` in order.
    """
    from common.profile import ClusterSpec, DeviceSpec
    from services.coordinator.recovery import capacities
    from services.profiler.cache import profile_key

    key = profile_key(profile.model, profile.device)
    cluster = ClusterSpec(
        devices=[
            DeviceSpec(
                name=d,
                memory_bytes=memory.get(d, 1 << 30),
                profile=key,
                slowdown=1.0 / min(1.0, cpus.get(d, 1.0)),
            )
            for d in devices
        ],
        bandwidth=125e6,
    )
    costs, speeds = capacities(cluster, {key: profile}, MICRO)
    cuts = cuts_by_speed(costs, {str(d): s for d, s in speeds.items()}, devices)
    return Extras(cluster, profile, throttle), cuts


def hetero_part(
    runner: Runner,
    extras: Extras,
    cuts: Sequence[int],
    rounds: int,
    past: Callable[[], bool] = lambda: False,
    save: Callable[[list[Run]], None] = lambda _: None,
) -> list[Run]:
    """Part 2: sync, then async, on the heterogeneous plan, each throttled at the same round."""
    runs: list[Run] = []
    plan = plan_of(HETERO_DEVICES, cuts, HETERO_WINDOW)
    for cfg in hetero_configs():
        if past():
            continue
        job = job_for(cfg, "hetero", rounds, model=HETERO_MODEL, data=HETERO_DATA, adapt=True)
        runner.extras = extras
        try:
            run, metrics = run_one(runner, "hetero", cfg, 0, job, plan)
        finally:
            runner.extras = None
        cut_round = runner.outcome.cut_round
        first = next((int(r["round"]) for r in run.replans if r["round"] is not None), None)
        run.phases = phases(metrics, cfg.global_batch, cut_round, first)
        run.phases["cut_round"] = cut_round
        runs.append(run)
        save(runs)
    return runs


def throttle_for(cpus: Mapping[str, float], cuts: Sequence[int], at: int) -> Throttle:
    """The device holding the most layers (it has layers to give away) cut to `HETERO_CUT`
    of its quota once `at` rounds commit; of equals, the later in the pipeline."""
    held = {d: cuts[i + 1] - cuts[i] for i, d in enumerate(HETERO_DEVICES)}
    device = max(reversed(HETERO_DEVICES), key=lambda d: held[d])
    return Throttle(at, device, cpus[device] * HETERO_CUT)
