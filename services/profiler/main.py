"""`asteroid-profiler`: measure a model on this device and share it through Redis.

The profile is stored under ``profile:<model key>:<device fingerprint>`` and
reused by later runs on the same device (same CPU, cores, quota, threads and
memory limit) unless `--refresh` is given. Progress shows as a bar on a
terminal and as log lines otherwise; a per-layer summary table ends the run.
With `--serve` the profiler instead answers the coordinator's requests until
stopped (see `services.profiler.service`).

Exit codes: 0 profile ready (with `--serve`: stopped by SIGTERM/SIGINT, like
the planner service), 2 invalid settings or model (with `--serve`: also a
`--keys` directory without a service key or the coordinator's public key), 3
profiling failed, 4 Redis (or, without a Redis URL, the coordinator that says
where it is) unreachable, 130 interrupted
(`common.exit_codes.ExitCode`).
"""

from __future__ import annotations

import json
import os
import sys
import time

import redis
import torch
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from common.accelerator import (
    AcceleratorInfo,
    accelerator_budget,
    describe_accelerator,
    full_precision,
)
from common.bootstrap import Stop, run_service
from common.curve import service_keys
from common.device import (
    default_threads,
    device_fingerprint,
    memory_budget,
    visible_cores,
)
from common.errors import AsteroidError, ConfigError, StoreError, Unreachable
from common.exit_codes import ExitCode
from common.locate import CoordinatorUnreachable, with_redis
from common.logging import bind_global, get_logger
from common.memory import keep_freed_memory
from common.model_key import model_key
from common.profile import Profile
from common.settings import ProfilerSettings
from common.store import Store
from common.zoo import ModelSpec, OptionValue
from services.profiler.cache import load_reusable, save
from services.profiler.layers import ProgressFn, Step, profile_model
from services.profiler.service import ProfilerService
from services.profiler.split import with_device_split_gain

__all__ = ["main", "parse_options", "run", "serve"]

log = get_logger(__name__)
REDIS_USER = "profiler"
"""The profiler's Redis ACL user (deploy/redis-acl.conf), whose password a key set may hold."""
LOCATE_PATIENCE_S = 30.0
"""Longest a one-off profile waits for the coordinator to say where Redis is."""


def parse_options(text: str) -> dict[str, OptionValue]:
    """Model options from a JSON object or ``key=value`` pairs (values read as JSON if they parse).

    Raises:
        ConfigError: Not an object of scalars, or a pair without ``=``.

    """
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"options are not valid JSON: {exc}") from exc
    else:
        raw = {}
        for pair in text.split(","):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"option {pair!r} is not key=value")
            try:
                raw[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                raw[key.strip()] = value.strip()
    if not isinstance(raw, dict):
        raise ConfigError(f"options must be an object, got {type(raw).__name__}")
    bad = {k: v for k, v in raw.items() if not isinstance(v, int | float | str | bool)}
    if bad:
        raise ConfigError(f"option values must be numbers, strings or booleans, got {bad}")
    return raw


def _measure(
    settings: ProfilerSettings,
    spec: ModelSpec,
    device: str,
    budget: int,
    accelerator: AcceleratorInfo,
) -> Profile:
    """Profile with a progress bar on a terminal, a log line per batch size otherwise."""
    started = time.perf_counter()
    console = Console(stderr=True)

    def measure(progress: ProgressFn) -> Profile:
        prof = profile_model(
            spec,
            settings.batch_sizes or None,
            settings.repeats,
            settings.warmup,
            budget,
            progress,
            optimizer=settings.optimizer,
            max_batch=settings.max_batch,
            device=device,
            allowed_modules=settings.model_modules,
            accelerator=accelerator,
        )
        return with_device_split_gain(prof, spec, settings.model_modules, accelerator=accelerator)

    def log_batch(step: Step) -> None:
        if step.layer == step.layers - 1:
            log.info("batch size measured", batch=step.batch, elapsed_s=_secs(started))

    if not console.is_terminal:
        return measure(log_batch)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("profiling", total=None)

        def show(step: Step) -> None:
            what = f"layer {step.layer + 1}/{step.layers}, batch {step.batch}"
            bar.update(task, completed=step.done, total=step.total, description=what)

        return measure(show)


def _warn_if_busy() -> None:
    """Warn when other processes keep the CPU busy: their load inflates every time."""
    load = os.getloadavg()[0]
    cores = visible_cores()
    if load > 0.5 * cores:
        log.warning(
            "the CPU looks busy (1-minute load); times will include the interference",
            load_1min=round(load, 2),
            cores=cores,
        )


def _secs(since: float) -> float:
    return round(time.perf_counter() - since, 2)


def _summary(prof: Profile, largest: int = 32) -> Table:
    """Per-layer times at one batch size (the largest up to `largest`), bytes, a total row."""
    j = max((i for i, b in enumerate(prof.batch_sizes) if b <= largest), default=0)
    table = Table(
        title=f"{prof.model} on {prof.device}, batch {prof.batch_sizes[j]}",
        caption="out, act: bytes per sample (output sent on; kept for backward)",
    )
    for col in ("#", "layer", "fwd ms", "bwd ms", "out KiB", "act KiB", "param KiB"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for lp in prof.layers:
        table.add_row(
            str(lp.index),
            lp.name,
            f"{lp.forward_s[j] * 1e3:.2f}",
            f"{lp.backward_s[j] * 1e3:.2f}",
            f"{lp.output_bytes / 1024:.1f}",
            f"{lp.activation_bytes / 1024:.1f}",
            f"{lp.param_bytes / 1024:.1f}",
        )
    table.add_row(
        "",
        "total",
        f"{sum(lp.forward_s[j] for lp in prof.layers) * 1e3:.2f}",
        f"{sum(lp.backward_s[j] for lp in prof.layers) * 1e3:.2f}",
        "",
        f"{sum(lp.activation_bytes for lp in prof.layers) / 1024:.1f}",
        f"{sum(lp.param_bytes for lp in prof.layers) / 1024:.1f}",
        style="bold",
    )
    return table


def run(settings: ProfilerSettings) -> ExitCode:
    """Profile (or reuse the stored profile of) one model on this device.

    Given a coordinator but no Redis URL, it asks that coordinator where Redis
    is (for up to `LOCATE_PATIENCE_S`); given neither, it uses the default URL.
    """
    try:
        given = settings.model_fields_set
        if "coordinator" in given and "redis_url" not in given:
            keys, _ = service_keys(settings.keys)
            settings = with_redis(settings, keys, REDIS_USER, patience_s=LOCATE_PATIENCE_S)
    except CoordinatorUnreachable as exc:
        log.error("profiling failed", error=str(exc))
        return ExitCode.UNREACHABLE
    except ConfigError as exc:
        log.error("invalid settings", error=str(exc))
        return ExitCode.CONFIG
    try:
        spec = ModelSpec(
            name=settings.model,
            num_classes=settings.num_classes,
            options=parse_options(settings.options),
        )
        accelerator = describe_accelerator(settings.accelerator)
        full_precision(accelerator)  # measure what a worker computes
    except ConfigError as exc:
        log.error("invalid settings", error=str(exc))
        return ExitCode.CONFIG
    threads = settings.threads or default_threads()
    torch.set_num_threads(threads)
    device = device_fingerprint(threads, settings.memory_budget, accelerator=accelerator)
    configured = settings.memory_budget
    budget = accelerator_budget(accelerator, memory_budget(configured), configured)
    key = model_key(spec)
    bind_global(device=device)
    store = Store(settings.redis_url, settings.cluster)
    try:
        store.ping()
        prof = None if settings.refresh else load_reusable(store, key, device, settings.batch_sizes)
        if prof is not None:
            log.info("profile reused from Redis", model=key, batch_sizes=prof.batch_sizes)
        else:
            log.info(
                "profiling",
                model=key,
                threads=threads,
                memory_budget=budget,
                accelerator=accelerator.name,
            )
            _warn_if_busy()
            started = time.perf_counter()
            prof = _measure(settings, spec, device, budget, accelerator)
            stored = save(store, prof)
            log.info(
                "profile measured and stored",
                model=key,
                batch_sizes=prof.batch_sizes,
                elapsed_s=_secs(started),
                redis_key=store.key("profile", stored),
            )
    except ConfigError as exc:
        log.error("invalid model", error=str(exc))
        return ExitCode.CONFIG
    except (AsteroidError, redis.RedisError) as exc:
        log.error("profiling failed", error=str(exc))
        return ExitCode.UNREACHABLE if isinstance(exc, Unreachable) else ExitCode.JOB_FAILED
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    finally:
        store.close()
    if settings.out is not None:
        try:
            settings.out.write_text(prof.model_dump_json(indent=2))
        except OSError as exc:
            log.error("cannot write the profile", path=str(settings.out), error=str(exc))
            return ExitCode.JOB_FAILED
        log.info("profile written", path=str(settings.out))
    Console().print(_summary(prof))
    return ExitCode.OK


def serve(settings: ProfilerSettings, stop: Stop) -> ExitCode:
    """Answer profile requests until SIGTERM or SIGINT, which stop it cleanly (exit code OK).

    Without a Redis URL, the coordinator is asked where Redis is first (the
    password comes from the key set, as Redis user `profiler`).
    """
    stop.on_stop(lambda name: log.info("stopping", signal=name))
    try:
        keys, _ = service_keys(settings.keys)
        settings = with_redis(settings, keys, REDIS_USER, stop.is_set)
        service = ProfilerService(settings)
    except CoordinatorUnreachable:  # only when stopped while asking
        log.info("stopped before the coordinator answered", coordinator=settings.coordinator)
        return ExitCode.OK
    except ConfigError as exc:
        log.error("profiler service cannot start", keys=str(settings.keys), error=str(exc))
        return ExitCode.CONFIG
    except zmq.ZMQError as exc:
        log.error("invalid coordinator address", address=settings.coordinator, error=str(exc))
        return ExitCode.CONFIG
    stop.on_stop(lambda _: service.stopping.set())
    bind_global(service=service.identity)
    try:
        service.serve()
    except StoreError as exc:
        log.error("profiler service cannot start", error=str(exc))
        return ExitCode.JOB_FAILED
    return ExitCode.OK


def _body(settings: ProfilerSettings, stop: Stop) -> ExitCode:
    """Serve with `--serve`; else profile once, unwound by KeyboardInterrupt at a stop."""
    keep_freed_memory()  # allocate like a worker does, so the times match its own
    if settings.serve:
        return serve(settings, stop)
    with stop.interrupting():
        return run(settings)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-profiler`."""
    sys.exit(run_service("profiler", ProfilerSettings, _body, argv))


if __name__ == "__main__":
    main()
