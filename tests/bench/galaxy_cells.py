"""What bench-galaxy measures, as data: the models, one measured cell, and the pure checks.

A cell is one serving job (testbed, model, mode, link) and its requests. The
checks that need no testbed live here too: the memory-unaware plans each mode
would run and whether they fit the budgets the workers report (the paper marks
the ones that do not as OOM), the cost model's prediction of a plan, and how
long Algorithm 1 takes to plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.errors import ConfigError, PlanError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from common.serving_messages import TransformerShape
from services.coordinator.galaxy.choose import STEP_LATENCY_S, Link, choose
from services.coordinator.galaxy.cost import predict
from services.coordinator.galaxy.planner import (
    fits,
    plan_galaxy,
    plan_local,
    plan_megatron,
    plan_sp,
)
from services.coordinator.serving import profile_sizes
from services.worker.galaxy.profiling import profile_blocks, scaled

__all__ = [
    "MODELS",
    "MODES",
    "SEQ_LEN",
    "VOCAB",
    "Cell",
    "ModelSize",
    "compute_scale",
    "device_profiles",
    "fitted_step_latency",
    "host_profile",
    "memory_unaware_plan",
    "planning_time_s",
    "predicted_s",
    "repredict",
    "request_ids",
    "ring_steps",
    "shape",
    "split_pays_from",
]

SEQ_LEN = 284
"""Tokens per request: QNLI's average, the paper's sequence length."""
VOCAB = 1000
"""Small on purpose: the LM head and embeddings are not what Galaxy splits."""


@dataclass(frozen=True)
class ModelSize:
    """A served model's shape before the layer count is chosen."""

    kind: str
    hidden: int
    heads: int
    ffn: int
    layers: int
    """The real model's layer count (a run may serve fewer: latency adds up per layer)."""


MODELS: dict[str, ModelSize] = {
    "bert_small": ModelSize("encoder", 512, 8, 2048, 4),
    "distilbert": ModelSize("encoder", 768, 12, 3072, 6),
    "gpt2": ModelSize("decoder", 768, 12, 3072, 12),
}
MODES = ("galaxy", "galaxy-no-overlap", "megatron", "sp", "local", "auto")
"""Labels of the modes compared; galaxy-no-overlap is galaxy with tile overlap off; auto is
the plan (mode and devices) the coordinator chooses with the cost model."""


def shape(model: str, layers: int) -> TransformerShape:
    """The served shape of `model` with `layers` layers, for SEQ_LEN-token requests.

    Raises:
        ConfigError: Unknown model or a layer count below 1.

    """
    size = MODELS.get(model)
    if size is None:
        raise ConfigError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    if layers < 1:
        raise ConfigError(f"layers must be >= 1, got {layers}")
    return TransformerShape(
        kind="encoder" if size.kind == "encoder" else "decoder",
        layers=layers,
        hidden=size.hidden,
        heads=size.heads,
        ffn=size.ffn,
        vocab_size=VOCAB,
        max_positions=SEQ_LEN,
        ln_eps=1e-12 if size.kind == "encoder" else 1e-5,
    )


def request_ids(n: int = SEQ_LEN, vocab: int = VOCAB) -> list[int]:
    """A fixed prompt: latency does not depend on the token values, only on their count."""
    return [(7 * i + 3) % vocab for i in range(n)]


@dataclass
class Cell:
    """One serving job of the bench and what it measured."""

    part: str
    """grid (env x model x mode), sweep (bandwidths on one env) or memory."""
    env: str
    model: str
    layers: int
    mode: str
    """One of MODES."""
    link_mbit: float
    state: str = "skipped"
    """ok, oom (plan does not fit the budgets, not run), failed or skipped."""
    latencies_s: list[float] = field(default_factory=list)
    """Each request after the warm-up: the coordinator's send-to-answer time."""
    median_s: float | None = None
    predicted_s: float | None = None
    """The cost model's latency for the plan run, from the bench's device profiles."""
    predicted_comm_s: float | None = None
    """Its ring communication part (before overlap hides any)."""
    plan: dict[str, Any] | None = None
    setup_s: float | None = None
    """ServeModel to running: profiling, planning and loading on the devices."""
    note: str = ""
    predicted_dev_s: float | None = None
    """The cost model's latency for the plan run, from the profiles the devices sent
    (what the coordinator planned on, ring step costs included)."""
    step_s: dict[str, float] = field(default_factory=dict)
    """Each device's measured ring step cost (`BlockProfile.step_s`)."""
    dev_profiles: dict[str, Any] = field(default_factory=dict)
    """The profiles the devices sent (JSON), for predicting again with a fitted step latency."""
    step_latency_s: float | None = None
    """The link's fixed seconds per ring step `predicted_dev_s` assumes (and auto was given)."""
    compute_scale: float = 1.0
    """The factor on the profiles' compute `predicted_dev_s` assumes (`compute_scale`)."""

    @property
    def overlap(self) -> bool:
        """Whether galaxy's tile overlap is on (ignored by the other modes)."""
        return self.mode != "galaxy-no-overlap"

    @property
    def spec_mode(self) -> str:
        """The `ServeSpec.mode` of this cell."""
        return "galaxy" if self.mode.startswith("galaxy") else self.mode

    @property
    def per_layer_ms(self) -> float | None:
        """Median latency per Transformer layer, in ms (embeddings and head included)."""
        return None if self.median_s is None else 1000 * self.median_s / self.layers


def host_profile(config: TransformerConfig, repeats: int = 3) -> BlockProfile:
    """This machine's block times at the sizes the coordinator asks devices for, one thread."""
    return profile_blocks(
        config,
        SEQ_LEN,
        profile_sizes(config.heads),
        profile_sizes(config.ffn),
        profile_sizes(SEQ_LEN),
        repeats,
        device="host",
    )


def device_profiles(host: BlockProfile, cpus: Mapping[str, float]) -> dict[str, BlockProfile]:
    """Each device's profile as its CPU quota makes it: the host's, `1 / cores` times slower.

    A quota of `c` cores lets a one-thread worker run a fraction `c` of the time,
    so compute-bound blocks take `1 / c` as long (never faster than the host).
    """
    return {name: scaled(host, max(1.0, 1.0 / cpu), name) for name, cpu in cpus.items()}


def memory_unaware_plan(
    mode: str,
    config: TransformerConfig,
    devices: Sequence[str],
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
) -> tuple[InferencePlan | None, list[str]]:
    """The plan `mode` makes without looking at memory, and who runs out of it (empty: fits).

    Megatron and sp split without regard to memory, so their plan is checked
    against the budgets afterwards; galaxy's Algorithm 1 and the local baseline
    choose with the budgets and fail only when nothing fits.
    """
    names = list(devices)
    if mode == "auto":  # the coordinator chooses among the plans that fit
        return None, []
    try:
        if mode.startswith("galaxy"):
            plan = plan_galaxy(config, names, profiles, budgets, SEQ_LEN, overlap=mode == "galaxy")
            return plan, []
        if mode == "local":
            return plan_local(config, names, profiles, budgets, SEQ_LEN), []
    except PlanError as exc:
        return None, [str(exc)]
    if mode == "megatron":
        plan = plan_megatron(config, names, SEQ_LEN)
    elif mode == "sp":
        plan = plan_sp(config, names, SEQ_LEN)
    else:
        raise ConfigError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    return plan, fits(plan, config, budgets)


def predicted_s(
    plan: InferencePlan,
    config: TransformerConfig,
    profiles: Mapping[str, BlockProfile],
    bandwidth_bps: float,
    step_latency_s: float = STEP_LATENCY_S,
) -> tuple[float, float]:
    """The cost model's (total, communication) seconds of one request under `plan`."""
    p = predict(plan, config, profiles, bandwidth_bps, step_latency_s=step_latency_s)
    return p.total_s, p.comm_s


def ring_steps(plan: InferencePlan, layers: int) -> int:
    """Ring steps one request takes under `plan` (the cost model's count)."""
    n = len(plan.devices)
    return layers * (1 if plan.mode == "sp" else 4) * (n - 1)


def _priced(cell: Cell) -> tuple[int, float, float] | None:
    """(ring steps, compute seconds, ring seconds without link latency) of `cell`'s plan.

    From the profiles the devices sent (their measured ring step work included);
    the ring part is what tile overlap leaves of it. None without a plan or profiles.
    """
    if not cell.plan or not cell.dev_profiles:
        return None
    plan = InferencePlan.model_validate(cell.plan)
    profiles = {d: BlockProfile.model_validate(p) for d, p in cell.dev_profiles.items()}
    config = shape(cell.model, cell.layers).config()
    p = predict(plan, config, profiles, cell.link_mbit * 1e6, step_latency_s=0.0)
    return ring_steps(plan, cell.layers), p.mha_s + p.mlp_s + p.con_s, p.comm_s - p.hidden_s


def compute_scale(cell: Cell) -> float | None:
    """Measured over predicted for a one-device cell: how far off the devices' profiles are.

    A local plan has no ring, so its measurement is compute alone; the ratio
    corrects the profiles' compute for the other cells of the same testbed and model.
    """
    priced = _priced(cell)
    if cell.median_s is None or priced is None or priced[0] or not priced[1] > 0:
        return None
    return cell.median_s / priced[1]


def fitted_step_latency(cell: Cell, scale: float = 1.0) -> float | None:
    """The link's fixed seconds per ring step that makes the cost model meet `cell`'s median.

    What the measurement has beyond the prediction without any link latency
    (compute times `scale`, see `compute_scale`), spread over the request's ring
    steps. None for a cell without ring steps or without a measurement.
    """
    priced = _priced(cell)
    if cell.median_s is None or priced is None or not priced[0]:
        return None
    steps, compute, ring = priced
    return max(0.0, (cell.median_s - scale * compute - ring) / steps)


def repredict(cell: Cell, step_latency_s: float, scale: float = 1.0) -> None:
    """Set `cell`'s device-profile prediction for a link step latency and compute scale."""
    priced = _priced(cell)
    if priced is None:
        return
    steps, compute, ring = priced
    cell.step_latency_s, cell.compute_scale = step_latency_s, scale
    cell.predicted_dev_s = scale * compute + ring + steps * step_latency_s


CROSSOVER_LINKS = (50.0, 125.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0)
"""Link rates (Mbit/s) at which `split_pays_from` asks the chooser."""


def split_pays_from(cell: Cell) -> tuple[float, str, float] | None:
    """The slowest link at which the chooser splits `cell`'s model over its testbed.

    The chooser (`services.coordinator.galaxy.choose`) on the profiles the
    devices sent for `cell`, their compute corrected by `cell.compute_scale`,
    with the testbed's fitted step latency, memory aside; (link Mbit/s, the plan
    chosen there, its predicted speedup over the best single device), or None
    when one device stays fastest up to `CROSSOVER_LINKS[-1]`.
    """
    if not cell.dev_profiles or cell.step_latency_s is None:
        return None
    profiles = {}
    for d, raw in cell.dev_profiles.items():
        p = BlockProfile.model_validate(raw)
        profiles[d] = scaled(p, cell.compute_scale).model_copy(update={"step_s": p.step_s})
    config = shape(cell.model, cell.layers).config()
    roomy = dict.fromkeys(profiles, 1 << 40)
    for mbit in CROSSOVER_LINKS:
        link = Link(mbit * 1e6, cell.step_latency_s)
        got = choose(config, list(profiles), profiles, roomy, SEQ_LEN, link)
        if len(got.plan.devices) > 1:
            alone = min(s for p, s in got.candidates if len(p.devices) == 1)
            text = f"{got.plan.mode} on {'+'.join(got.plan.devices)}"
            return mbit, text, alone / got.predicted_s
    return None


def planning_time_s(
    config: TransformerConfig,
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
    repeats: int = 20,
) -> float:
    """Median seconds of one Algorithm 1 run (`plan_galaxy`) over the given devices."""
    names = list(profiles)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_galaxy(config, names, profiles, budgets, SEQ_LEN)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
