"""Settings of every service, from `ASTEROID_*` variables, overridden by flags.

Each field has a default and a description so that `--help` and docs/configuration.md's
configuration table are generated from one place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from common.secrets import mask_url, remember_url, url_with_password_file
from common.units import Bytes, BytesPerSecond

__all__ = [
    "LOG_LEVELS",
    "POOL_MAX_BYTES",
    "REDIS_OUTAGE_S",
    "AcceleratorChoice",
    "CommonSettings",
    "CoordinatorSettings",
    "FederationSettings",
    "ProfilerSettings",
    "WorkerSettings",
]

POOL_MAX_BYTES = 4 << 30
"""Default cap on a task pool's bytes: far above what a round of an edge plan holds."""
REDIS_OUTAGE_S = 120.0
"""Default longest Redis outage a service waits out: a router's reboot, a Redis restart."""
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
"""The levels `--log-level` takes, least severe first."""
AcceleratorChoice = Literal["auto", "cpu", "cuda"]
"""What a worker or profiler computes on (`common.accelerator` resolves it)."""
_ACCELERATOR_HELP = (
    "Processor the stage computes on: auto (a CUDA GPU when torch sees one, else the CPU), "
    "cpu, or cuda (an error without a GPU). Must match between a device's profiler and worker."
)
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_ZMQ_ADDRESS = re.compile(r"^(tcp://\S+:([0-9]{1,5}|\*)|ipc://\S+)$")


def _zmq_address(value: str) -> str:
    """`value` if it is a ZeroMQ address a service can bind or connect to."""
    if not _ZMQ_ADDRESS.match(value):
        raise PydanticCustomError(
            "zmq_address", "expected an address like tcp://HOST:PORT (or ipc://PATH)"
        )
    return value


class CommonSettings(BaseSettings):
    """What every service needs: where shared state lives, logging, wire limits."""

    model_config = SettingsConfigDict(
        env_prefix="ASTEROID_", extra="ignore", cli_kebab_case=True, cli_implicit_flags=True
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis holding shared state and checkpoints."
    )
    redis_password_file: Path | None = Field(
        None,
        description="File holding the Redis password, joined to the user of --redis-url, so "
        "the password is neither in argv (`ps` shows it) nor in the environment.",
    )
    cluster: str = Field("default", description="Key prefix separating clusters in one Redis.")
    coordinator: str = Field(
        "tcp://127.0.0.1:5555", description="Control-plane address of the coordinator."
    )
    log_format: Literal["auto", "console", "json"] = Field(
        "auto", description="Log rendering: console on a terminal, JSON otherwise (auto)."
    )
    log_level: LogLevel = Field(
        "info", description="Minimum log level: " + ", ".join(LOG_LEVELS) + "."
    )
    heartbeat_s: float = Field(0.5, gt=0, description="Seconds between worker heartbeats.")
    redis_outage_s: float = Field(
        REDIS_OUTAGE_S,
        gt=0,
        description="Longest Redis outage a service rides out, retrying with backoff (a job "
        "pauses at its next round boundary), before what waits fails with a named error.",
    )
    max_header_bytes: Bytes = Field(
        1 << 20,
        gt=0,
        description="Largest message header (msgpack frame) accepted (bytes, or like 1MiB).",
    )
    max_tensor_bytes: Bytes = Field(
        1 << 30,
        gt=0,
        description="Largest tensor frame accepted, larger announcements are refused (bytes, "
        "or like 1GiB).",
    )
    inbound_margin: Bytes = Field(
        512 << 20,
        gt=0,
        description="Memory (bytes, or like 512MiB) a service may grow beyond its planned size "
        "before it resets its listening socket: ZeroMQ keeps a multipart message's frames "
        "until its last one, however many a peer sends.",
    )
    keys: Path | None = Field(
        None,
        description="CURVE key set directory (made by `asteroid keys init`) holding this "
        "process's secret key and the set's public keys; required beyond loopback.",
    )
    model_modules: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Modules whose package.module:factory models jobs may build, comma "
        "separated (empty: zoo models only). Importing runs code, so only this setting, "
        "never a job, allows a module; a job may name only the callables the module "
        "declares with @common.zoo.model_factory.",
    )

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        """Fields as repr() and str() show them: the Redis URL without its password.

        Settings end up in log lines and error messages; the URL itself stays
        intact for the code that connects with it.
        """
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "redis_url" and isinstance(value, str) else value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(_REDIS_SCHEMES) or value.endswith("://"):
            raise PydanticCustomError(
                "redis_url", "expected a URL like redis://HOST:6379/0 (or rediss://, unix://)"
            )
        remember_url(value)  # its password is hidden wherever this process shows text
        return value

    @model_validator(mode="after")
    def _password_from_file(self) -> CommonSettings:
        if self.redis_password_file is not None:
            try:
                url = url_with_password_file(self.redis_url, self.redis_password_file)
            except ValueError as exc:
                where = "--redis-password-file (ASTEROID_REDIS_PASSWORD_FILE)"
                raise PydanticCustomError("redis_password_file", f"{where}: {exc}") from None
            object.__setattr__(self, "redis_url", url)
            self.redis_password_file = None  # read once: a copy of these settings keeps the URL
        return self

    @field_validator("coordinator")
    @classmethod
    def _coordinator_address(cls, value: str) -> str:
        return _zmq_address(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        # INFO, as Python's logging spells it, is the same level
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("model_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        # "a.b,c" or '["a.b", "c"]' from the environment or a flag; a list from code
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            return value
        out: list[object] = []
        for item in items:
            if isinstance(item, str) and item.lstrip().startswith("["):
                out.extend(json.loads(item))
            elif isinstance(item, str):
                out.extend(m.strip() for m in item.split(",") if m.strip())
            else:
                out.append(item)
        return out


class WorkerSettings(CommonSettings):
    """A worker: its name, where peers reach it, and how much of the device it may use."""

    device: str = Field("", description="Device name; defaults to the host name and pid.")
    data_host: str = Field(
        "",
        description="Interface the data-plane socket binds to (empty: loopback if the "
        "coordinator is on loopback, else every interface).",
    )
    data_port: int = Field(
        5556,
        ge=0,
        le=65535,
        description="Data-plane port, fixed so a firewall can be opened for it (0 picks a free "
        "one: several workers on one machine each need their own).",
    )
    link_port: int = Field(
        5557,
        ge=0,
        le=65535,
        description="Port of the bandwidth sink peers measure their link to this worker with; "
        "it binds where the data socket does (0 picks a free one).",
    )
    advertise_host: str = Field(
        "",
        description="Host peers use to reach this worker (empty: data_host, or the address "
        "that routes to the coordinator).",
    )
    threads: int = Field(
        0, ge=0, description="Torch threads (0: cores divided by workers_per_host)."
    )
    accelerator: AcceleratorChoice = Field("auto", description=_ACCELERATOR_HELP)
    workers_per_host: int = Field(
        1, ge=1, description="Workers sharing this machine, for the default thread count."
    )
    memory_budget: Bytes = Field(
        0,
        ge=0,
        description="Bytes training may use on this device, e.g. 2GB or 1536MiB (0: the cgroup "
        "limit minus what the worker holds after start-up, else free memory).",
    )
    task_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait for an activation, gradient or reduce chunk."
    )
    pool_max_bytes: Bytes = Field(
        POOL_MAX_BYTES,
        gt=0,
        description="Most bytes (or e.g. 4GiB) of received activations, gradients and reduce "
        "chunks the task pool holds; parts beyond are refused and logged with their sender.",
    )
    fail_at: str = Field(
        "",
        description="Fault injection for tests and benchmarks: kill this worker with SIGKILL "
        "at ROUND:PHASE[:MB] (comma separated for several), PHASE one of forward, backward "
        "(MB: micro-batch, default the first run), allreduce, step or done (after its "
        "RoundDone was sent). Empty: never.",
    )

    FAIL_PHASES: ClassVar[tuple[str, ...]] = ("forward", "backward", "allreduce", "step", "done")
    """Where `fail_at` can kill, in the order a round reaches them."""

    @staticmethod
    def parse_fail_at(text: str) -> tuple[tuple[int, str, int | None], ...]:
        """The (round, phase, micro-batch or None) points of a `fail_at` spec.

        Strict, because a typo that silently never fires would make a fault
        test pass without injecting anything.
        """
        points = []
        for item in text.split(",") if text.strip() else []:
            parts = item.strip().split(":")
            if not 2 <= len(parts) <= 3 or not all(re.fullmatch(r"[0-9]+", p) for p in parts[::2]):
                raise ValueError(
                    f"fail_at item {item.strip()!r} is not ROUND:PHASE[:MB] "
                    "(ROUND and MB whole numbers, items separated by commas)"
                )
            phase = parts[1]
            if phase not in WorkerSettings.FAIL_PHASES:
                raise ValueError(
                    f"fail_at item {item.strip()!r}: phase {phase!r} is not one of "
                    + ", ".join(WorkerSettings.FAIL_PHASES)
                )
            if len(parts) == 3 and phase not in ("forward", "backward"):
                raise ValueError(
                    f"fail_at item {item.strip()!r}: only forward and backward take a micro-batch"
                )
            points.append((int(parts[0]), phase, int(parts[2]) if len(parts) == 3 else None))
        return tuple(points)

    @field_validator("fail_at")
    @classmethod
    def _check_fail_at(cls, value: str) -> str:
        cls.parse_fail_at(value)
        return value.strip()


class CoordinatorSettings(CommonSettings):
    """The coordinator: how long it waits for workers and rounds."""

    CLI_HIDDEN: ClassVar[frozenset[str]] = frozenset({"coordinator"})
    """Settings its `--help` does not offer: it is the coordinator (it binds --bind)."""

    bind: str = Field("tcp://127.0.0.1:5555", description="Control-plane address to bind.")
    join_timeout_s: float = Field(60.0, gt=0, description="Longest wait for a plan's workers.")
    round_timeout_s: float = Field(300.0, gt=0, description="Longest wait for one round.")
    heartbeat_misses: int = Field(
        6,
        ge=1,
        description="Upper bound, in heartbeats, on the silence after which a worker of the "
        "running job is a suspect and is probed (dead only if the probe goes unanswered); "
        "the deadline in force follows the measured heartbeat gaps (derive_timeouts).",
    )
    probe_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Upper bound on the wait for a suspect's answer to a direct probe before "
        "it is declared dead; the wait in force follows measured round trips.",
    )
    flap_grace_s: float = Field(
        1.0,
        gt=0,
        le=600,
        description="Upper bound on how long a worker whose connection closed may take to "
        "come back before that counts as a loss (a flaky link is not one); the grace in "
        "force follows measured round trips, at least 0.3 s.",
    )
    peer_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="Upper bound on how long a worker waits for a neighbour's data before it "
        "reports the neighbour silent; the wait in force is 3 rounds as measured (or as "
        "the plan predicts), at least 1 s.",
    )
    derive_timeouts: bool = Field(
        True,
        description="Derive the timeouts in force from measured heartbeat gaps, round trips "
        "and round times, with the settings above as upper bounds (off: the settings as "
        "they are); `asteroid status` shows them.",
    )
    hung_min_s: float = Field(
        30.0,
        gt=0,
        description="Least time a worker that heartbeats may make no progress on a round "
        "(evaluation, checkpoint) before it is declared hung.",
    )
    hung_factor: float = Field(
        10.0,
        gt=0,
        description="The hung watchdog is this many times the plan's predicted round time, "
        "when the plan predicts one and that is longer than hung_min_s.",
    )
    device_expiry_s: float = Field(
        30.0,
        gt=0,
        description="Seconds after its last heartbeat that a device not in the running "
        "job's plan is forgotten, in memory and in Redis (never sooner than heartbeat_s "
        "times heartbeat_misses, when a worker is declared dead).",
    )
    max_unassigned_devices: int = Field(
        256,
        ge=1,
        description="Most devices the coordinator remembers that the running job's plan does "
        "not name; heartbeats of further new ids are dropped (and counted in the log).",
    )
    model_check_memory_mb: int = Field(
        6144,
        ge=64,
        le=1 << 24,
        description="Memory a submitted job's model may take while it is checked: it is "
        "built in a child process with this address-space limit, never in the coordinator.",
    )
    model_check_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Longest build of a submitted job's model when checked."
    )
    job: Path | None = Field(None, description="Job spec (YAML) to run at start.")
    plan: str | None = Field(
        None,
        description="Plan for --job: a JSON/YAML file, `redis` (the job's stored plan) or "
        "`planner:NAME` (ask the planner service, with --cluster-spec).",
    )
    cluster_spec: Path | None = Field(
        None,
        description="Cluster spec (YAML: devices, memory, bandwidth) for planning; without "
        "it, devices come from the workers that joined.",
    )
    plan_timeout_s: float = Field(120.0, gt=0, description="Longest wait for the planner.")
    profile_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for one device kind's profile."
    )
    link_bandwidth: BytesPerSecond = Field(
        125e6,
        gt=0,
        description="Bytes/s (a number, or like 125MB/s; bits are refused) the planner assumes "
        "between workers whose link could not be measured, when no --cluster-spec gives the "
        "links.",
    )
    link_probe_bytes: Bytes = Field(
        4 << 20,
        ge=0,
        description="Bytes (or e.g. 4MiB) streamed to measure each pair of a job's workers "
        "before it is planned (0: measure nothing, every link gets link_bandwidth).",
    )
    link_probe_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Longest one pair's measurement may take; a pair not measured by then "
        "gets link_bandwidth.",
    )
    resume: bool = Field(False, description="Continue --job from its newest committed checkpoint.")
    replace: bool = Field(
        False,
        description="Let --job reuse an existing job id: its checkpoints, metrics and "
        "events are deleted first (without it, an existing id is refused).",
    )
    shutdown_workers: bool = Field(
        False, description="Tell the workers to exit when the --job finishes."
    )
    metrics_dir: Path | None = Field(
        None,
        description="Directory to stream each job's metrics to as rounds are committed: "
        "JOB.csv and TensorBoard event files in JOB/ (unset: Redis only; `asteroid "
        "export-metrics` writes the same files later). Trouble writing them never stops a job.",
    )

    @field_validator("bind")
    @classmethod
    def _bind_address(cls, value: str) -> str:
        return _zmq_address(value)


class FederationSettings(CommonSettings):
    """The federation service: where homes reach it and what it runs."""

    CLI_HIDDEN: ClassVar[frozenset[str]] = frozenset({"coordinator"})
    """Settings its `--help` does not offer: homes' coordinators reach it, not it them."""

    bind: str = Field("tcp://127.0.0.1:5560", description="Address homes' coordinators reach.")
    spec: Path = Field(description="Federation spec (YAML): model, strategy, homes, updates.")
    exit_when_done: bool = Field(
        False,
        description="Exit once the last update is merged and every home has been told "
        "(or done_grace_s later); otherwise keep answering `done` until stopped.",
    )
    done_grace_s: float = Field(
        30.0, gt=0, le=3600, description="With exit_when_done: longest wait for homes to ask."
    )
    replace: bool = Field(
        False,
        description="Start the federation afresh, deleting its state in Redis (without it, a "
        "restarted federation continues from its last global model and groups).",
    )

    @field_validator("bind")
    @classmethod
    def _bind_address(cls, value: str) -> str:
        return _zmq_address(value)


class ProfilerSettings(CommonSettings):
    """What to profile and how carefully; device settings match the worker's."""

    serve: bool = Field(
        False,
        description="Answer the coordinator's profile requests until stopped, instead of "
        "profiling once; each request names the model, threads, memory budget, batch sizes "
        "and optimizer, and stored profiles are always reused.",
    )
    model: str = Field(
        "small_cnn",
        description="Zoo model (bert_small, efficientnet_b1, fl_cnn, mlp, mobilenet_v2, "
        "resnet18, resnet50, small_cnn), or package.module:factory.",
    )
    num_classes: int = Field(10, ge=1, description="Width of the model's logits.")
    options: str = Field("", description='Model options: a JSON object, or "key=value,key=value".')
    batch_sizes: list[int] = Field(
        default_factory=list,
        description="Batch sizes to measure (e.g. 1,2,4); empty: powers of two that fit memory.",
    )
    max_batch: int = Field(256, ge=1, description="Largest automatic batch size.")
    repeats: int = Field(5, ge=1, description="Timed runs per layer and batch size (medians).")
    warmup: int = Field(2, ge=0, description="Untimed runs before the timed ones.")
    memory_budget: Bytes = Field(
        0,
        ge=0,
        description="Bytes this device may use, e.g. 2GB or 1536MiB (0: cgroup limit, else "
        "free memory).",
    )
    threads: int = Field(0, ge=0, description="Torch threads (0: the cores this process may use).")
    accelerator: AcceleratorChoice = Field("auto", description=_ACCELERATOR_HELP)
    refresh: bool = Field(False, description="Measure again even if Redis holds a profile.")
    optimizer: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="Optimizer whose state is counted."
    )
    out: Path | None = Field(None, description="Also write the profile to this JSON file.")
