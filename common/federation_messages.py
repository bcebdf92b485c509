"""Messages between a home's coordinator and the federation service (`asteroid-federation`).

The flow: a home joins (`JoinFederation`: its sample count and label histogram, never
a sample), asks for work (`FetchModel`), gets a model to train from or a reason to wait
(`FederatedModel`), trains its local rounds and sends the result (`HomeUpdate`); the
federation answers joins and updates with `FederationReply`. A model travels as one
uint8 tensor frame holding a safetensors file (parsed, never executed). Every size
a home chooses is bounded here, before anything is allocated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.job import JOB_ID_PATTERN, MAX_HOMES
from common.message_base import WireModel
from common.zoo import ModelSpec

__all__ = [
    "MAX_FL_CLASSES",
    "FederatedModel",
    "FederationReply",
    "FetchModel",
    "HomeUpdate",
    "JoinFederation",
]

MAX_FL_CLASSES = 10_000
"""Most classes a home's label histogram may have."""
MAX_SAMPLES = 1 << 40
MAX_LATENCY_S = 86_400.0 * 30
MAX_ROUND_ID = 1 << 62


class JoinFederation(WireModel):
    """A home joins: what it trains and how much of each label it holds."""

    type: Literal["join_federation"] = "join_federation"
    federation: str = Field(pattern=JOB_ID_PATTERN)
    home: int = Field(ge=0, lt=MAX_HOMES)
    model: ModelSpec
    num_samples: int = Field(ge=1, le=MAX_SAMPLES)
    histogram: list[int] = Field(min_length=1, max_length=MAX_FL_CLASSES)

    @model_validator(mode="after")
    def _counts(self) -> JoinFederation:
        if any(c < 0 for c in self.histogram) or sum(self.histogram) != self.num_samples:
            raise ValueError(
                f"the histogram must hold non-negative counts summing to num_samples "
                f"({self.num_samples}), got a sum of {sum(self.histogram)}"
            )
        return self


class FetchModel(WireModel):
    """A home asks for its next task."""

    type: Literal["fetch_model"] = "fetch_model"
    federation: str = Field(pattern=JOB_ID_PATTERN)
    home: int = Field(ge=0, lt=MAX_HOMES)


class FederatedModel(WireModel):
    """A home's next task; with ``train`` or ``probe``, one frame: the model's safetensors.

    ``train``: start from this model, send the update of round ``round_id``.
    ``probe``: the same, but the home is out of every group, so only its latency
    counts (it rejoins when a group's band holds it). ``wait``: ask again after
    ``wait_s``. ``done``: the federation has run its last update.
    """

    type: Literal["federated_model"] = "federated_model"
    federation: str = Field(pattern=JOB_ID_PATTERN)
    home: int = Field(ge=0, lt=MAX_HOMES)
    status: Literal["train", "probe", "wait", "done"]
    round_id: int = Field(-1, ge=-1, le=MAX_ROUND_ID)
    version: int = Field(0, ge=0, le=MAX_ROUND_ID)
    wait_s: float = Field(0.0, ge=0, le=60)


class HomeUpdate(WireModel):
    """A home's model after its local rounds; one frame: the model's safetensors."""

    type: Literal["home_update"] = "home_update"
    federation: str = Field(pattern=JOB_ID_PATTERN)
    home: int = Field(ge=0, lt=MAX_HOMES)
    round_id: int = Field(ge=0, le=MAX_ROUND_ID)
    num_samples: int = Field(ge=1, le=MAX_SAMPLES)
    latency_s: float = Field(gt=0, le=MAX_LATENCY_S, allow_inf_nan=False)
    local_accuracy: float = Field(
        -1.0, ge=-1.0, le=1.0, description="Held-out accuracy the home measured (-1: none)."
    )


class FederationReply(WireModel):
    """Answer to a join or an update: taken, or refused with the reason."""

    type: Literal["federation_reply"] = "federation_reply"
    federation: str = Field(pattern=JOB_ID_PATTERN)
    home: int = Field(ge=0, lt=MAX_HOMES)
    ok: bool
    error: str = Field("", max_length=2000)
    stale: bool = Field(
        False, description="Refused only because its round had closed: ask for the next task."
    )
    version: int = Field(0, ge=0, le=MAX_ROUND_ID)
