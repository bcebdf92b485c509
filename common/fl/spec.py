"""What a federation runs: its model, strategy, homes and budget, as a file the service reads."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.job import JOB_ID_PATTERN, MAX_HOMES
from common.spec_files import load_spec_file
from common.zoo import ModelSpec

__all__ = [
    "STRATEGY_NAMES",
    "CombineRule",
    "FederationSpec",
    "RobustAggregation",
    "StrategyName",
    "load_federation",
]

StrategyName = Literal["ecofl", "fedavg", "fedasync", "fedat", "astraea"]
# The order the spec's documentation lists them in; `services.federation.strategies`
# builds each of these and no other.
STRATEGY_NAMES: tuple[StrategyName, ...] = ("fedavg", "fedasync", "fedat", "astraea", "ecofl")

CombineRule = Literal["mean", "trimmed_mean", "median"]


class RobustAggregation(BaseModel):
    """How a federation screens and combines homes' updates (the spec's ``aggregation``).

    The defaults protect without changing an honest federation's FedAvg: honest homes'
    deltas stay well inside ten times the median, their sample counts inside ten times
    the median count.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    combine: CombineRule = Field(
        "mean",
        description="mean (sample-weighted, FedAvg), trimmed_mean or median (coordinate-wise, "
        "unweighted).",
    )
    trim: float = Field(
        0.2, ge=0, lt=0.5, description="Fraction trimmed from each end by trimmed_mean."
    )
    clip_norm: float | None = Field(
        10.0,
        gt=1,
        le=1e6,
        description="Clip an update's delta from the model it trained from to this multiple "
        "of the median delta norm (None: no clipping).",
    )
    reject_norm: float | None = Field(
        1000.0,
        gt=1,
        le=1e12,
        description="Reject an update whose delta norm exceeds this multiple of the median "
        "(None: never).",
    )
    sample_clip: float | None = Field(
        10.0,
        gt=1,
        le=1e6,
        description="Cut a sample count above this multiple of the median count down to it "
        "(None: never).",
    )
    max_samples: int = Field(
        10_000_000, ge=1, le=1 << 40, description="Most samples a home may claim (join refused)."
    )
    history: int = Field(
        32, ge=0, le=10_000, description="Recent taken updates the medians also count."
    )


class FederationSpec(BaseModel):
    """One federation (`asteroid-federation --spec FILE`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    federation_id: str = Field(
        pattern=JOB_ID_PATTERN, description="Name of the federation; keys its state in Redis."
    )
    model: ModelSpec = Field(description="The model every home trains (zoo name and options).")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the initial global model.")
    homes: int = Field(ge=1, le=MAX_HOMES, description="Homes to wait for before the first round.")
    strategy: StrategyName = Field(
        "ecofl",
        description="How homes are grouped and updates merged: " + ", ".join(STRATEGY_NAMES),
    )
    groups: int = Field(2, ge=1, le=MAX_HOMES, description="Groups (ecofl, fedat, astraea).")
    mixing: float = Field(
        0.6, gt=0, le=1, description="Weight alpha of a group model merged into the global one."
    )
    staleness: Literal["polynomial", "constant"] = Field(
        "polynomial", description="How a stale group model's weight decays."
    )
    exponent: float = Field(0.5, ge=0, le=10, description="The staleness decay's exponent.")
    rt_fraction: float = Field(
        0.5, gt=0, le=100, description="Regrouping band RT^g as a fraction of a group's latency."
    )
    latency_weight: float = Field(
        1.0, ge=0, le=1000, description="Weight of latency spread against data gap in COST."
    )
    latency_window: int = Field(
        3,
        ge=1,
        le=1000,
        description="A home's latency for regrouping is the median of its last this many "
        "rounds (1: its latest, as Algorithm 1 has it): one slow round moves nobody.",
    )
    regroup_dwell: int = Field(
        2,
        ge=1,
        le=1000,
        description="A home moves, drops or rejoins only after this many consecutive "
        "rounds out of its group's band (1: at once), and stays that long where it went.",
    )
    aggregation: RobustAggregation = Field(
        default_factory=RobustAggregation,
        description="How homes' updates are screened (sample counts, delta norms) and combined.",
    )
    updates: int = Field(20, ge=1, le=1_000_000, description="Global model updates to run.")
    round_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="A group's round ends this long after it started."
    )
    eval_digits_seed: int | None = Field(
        0,
        ge=0,
        description="Score each global model on the held-out part of scikit-learn's digits "
        "split with this seed (None: no scoring).",
    )


def load_federation(path: Path) -> FederationSpec:
    """The federation spec in YAML/JSON file `path` (ConfigError names a bad field)."""
    return load_spec_file(path, FederationSpec, "federation spec")
