"""Messages of Galaxy-style serving: load a model across devices, then answer requests.

The flow: an operator's `ServeModel` names a model and the devices; the
coordinator asks each device to time the Transformer blocks (`ProfileBlocks`,
`BlocksProfiled`), plans the split, has every device load its shard
(`LoadShard`, `ShardLoaded`), then runs each `InferRequest` on all of them
(`RunInference`); the ring's first device returns the output
(`InferenceDone`) and the requester gets `InferReply`. Between devices, tiles of
hidden states travel as `HmpTile` on the data plane. Every size a peer chooses
is bounded here, before anything is allocated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.galaxy.config import MAX_ROPE_THETA, TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from common.ids import DeviceId, JobId
from common.job import JOB_ID_PATTERN
from common.message_base import WireModel

__all__ = [
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_TOKENS",
    "MAX_STOP_IDS",
    "MAX_TEMPERATURE",
    "BlocksProfiled",
    "HmpTile",
    "InferChunk",
    "InferReply",
    "InferRequest",
    "InferenceDone",
    "InferenceProgress",
    "LoadShard",
    "ProfileBlocks",
    "Refusal",
    "RunInference",
    "Sampling",
    "ServeModel",
    "ServeSpec",
    "ShardLoaded",
    "TransformerShape",
]

MAX_PROMPT_TOKENS = 8192
"""Longest prompt a request may carry (also the longest position table a model may have)."""
MAX_NEW_TOKENS = 1024
"""Most tokens one request may ask to generate."""
MAX_STOP_IDS = 16
"""Most stop token ids one request may name."""
MAX_TEMPERATURE = 2.0
"""The highest sampling temperature (OpenAI's bound)."""
MAX_WAIT_S = 3600.0
"""Longest a request may ask to wait for its turn."""
MAX_OUTPUT = 100_000
"""Most numbers an answer's output row may hold (GPT-2's 50,257-token vocabulary fits):
the control plane carries no tensor frames, so the row travels in the header."""
MAX_PATH = 4096
"""Longest model folder path a serving spec may name."""
MAX_PROFILE_POINTS = 64
"""Most partition sizes one block is timed at."""
TAG_PATTERN = r"^[A-Za-z0-9_.:/@-]{1,96}$"
"""A ring message's tag: which layer, block and step it belongs to."""


class TransformerShape(WireModel):
    """A Transformer's shape on the wire; bounded, so a hostile one allocates nothing."""

    kind: Literal["encoder", "decoder"]
    layers: int = Field(ge=1, le=256)
    hidden: int = Field(ge=1, le=16384)
    heads: int = Field(ge=1, le=256)
    ffn: int = Field(ge=1, le=65536)
    vocab_size: int = Field(ge=1, le=1_000_000)
    max_positions: int = Field(ge=1, le=MAX_PROMPT_TOKENS)
    ln_eps: float = Field(1e-12, gt=0.0, le=0.1)
    num_classes: int = Field(0, ge=0, le=100_000)
    kv_heads: int | None = Field(
        None, ge=1, le=256, description="Key/value heads (GQA when fewer than heads)."
    )
    norm: Literal["layer", "rms"] = "layer"
    positions: Literal["absolute", "rope"] = "absolute"
    rope_theta: float = Field(10000.0, gt=0.0, le=MAX_ROPE_THETA)
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] | None = None
    qkv_bias: bool = True
    o_bias: bool = True
    mlp_bias: bool = True
    tied_head: bool = True

    def config(self) -> TransformerConfig:
        """The shape as the executor's config; ConfigError if it cannot be split by heads."""
        return TransformerConfig(**self.model_dump())

    @classmethod
    def of(cls, config: TransformerConfig) -> TransformerShape:
        """The wire form of `config`."""
        return cls(**{name: getattr(config, name) for name in cls.model_fields})


class ServeSpec(WireModel):
    """What to serve and how: the model's source, the devices and the parallelism."""

    serve_id: JobId = Field(pattern=JOB_ID_PATTERN, description="Name of this serving job.")
    source: Literal["init", "transformers", "checkpoint", "pretrained"] = Field(
        "init",
        description="Weights: `init` (random, seeded), `transformers` (built by the "
        "transformers library from the shape, seeded), `checkpoint` (a bert_small "
        "training job's committed checkpoint) or `pretrained` (a model folder: config.json "
        "and safetensors, at `path` on every device).",
    )
    model: TransformerShape | None = Field(
        None,
        description="The shape, for `init`, `transformers` and `pretrained` (the folder's, "
        "filled in by whoever submits: `asteroid serve` reads it); a checkpoint has its own.",
    )
    path: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PATH,
        pattern=r"^/[^\x00-\x1f]*$",
        description="The model folder of `pretrained`, an absolute path, the same on every device.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1)
    job: JobId | None = Field(None, pattern=JOB_ID_PATTERN, description="The training job.")
    round: int | None = Field(None, ge=0, description="Its checkpoint; default the latest.")
    mode: Literal["auto", "galaxy", "megatron", "sp", "local"] = Field(
        "auto",
        description="auto (the mode and devices the cost model predicts fastest, one device "
        "included), galaxy (hybrid model parallelism), megatron (tensor parallelism), "
        "sp (sequence parallelism) or local (the single best device).",
    )
    link_bps: float | None = Field(
        None,
        gt=0,
        le=1e12,
        description="Bits/s of the devices' links, for auto's cost model; default 1 Gbit/s.",
    )
    step_latency_s: float | None = Field(
        None,
        ge=0,
        le=1.0,
        description="Fixed seconds per ring step beyond its bytes, for auto's cost model; "
        "default 2 ms (as measured on the emulated testbed).",
    )
    overlap: bool = Field(True, description="Overlap ring steps with GEMM tiles (galaxy).")
    devices: list[DeviceId] = Field(
        default_factory=list, max_length=64, description="Devices to use; empty: every worker."
    )
    seq_len: int = Field(
        284, ge=1, le=MAX_PROMPT_TOKENS, description="Sequence length to plan for."
    )

    @property
    def job_id(self) -> str:
        """The serving job's id (`serve_id`), under the name training jobs use."""
        return self.serve_id

    @model_validator(mode="after")
    def _source_named(self) -> ServeSpec:
        if self.source == "pretrained" and self.path is None:
            raise ValueError("source pretrained needs `path` (the model folder on each device)")
        if self.source != "pretrained" and self.path is not None:
            raise ValueError(f"`path` is for source pretrained, not {self.source}")
        if self.source == "pretrained" and self.model is None:
            raise ValueError(
                "source pretrained needs `model`: the shape in the folder's config.json "
                "(asteroid serve fills it in)"
            )
        if self.source == "checkpoint" and self.job is None:
            raise ValueError("source checkpoint needs `job` (the training job to serve)")
        if self.source != "checkpoint" and self.model is None:
            raise ValueError(f"source {self.source} needs `model` (the Transformer's shape)")
        return self


class Sampling(WireModel):
    """How a decoder picks each generated token, and when it stops; shared by the requests.

    Temperature 0 is greedy (the most likely token); above it, tokens are drawn
    from the top-p nucleus of softmax(logits / temperature) with a generator
    seeded from `seed` and the step, so the same request gives the same tokens.
    A token in `stop` ends the generation and is left out of it.
    """

    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="0: greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to sample from.")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    stop: list[int] = Field(
        default_factory=list,
        max_length=MAX_STOP_IDS,
        description="Token ids that end generation (EOS), left out of the output.",
    )

    @field_validator("stop")
    @classmethod
    def _ids(cls, stop: list[int]) -> list[int]:
        if any(not 0 <= t < 1_000_000 for t in stop):
            raise ValueError(f"stop ids must be in [0, 1000000), got {stop}")
        return stop


# --- operator -> coordinator -------------------------------------------------


class ServeModel(WireModel):
    """Plan a model across devices and load it; the reply is a JobReply."""

    type: Literal["serve_model"] = "serve_model"
    spec: ServeSpec


class InferRequest(Sampling):
    """One inference: token ids in; logits, and generated tokens if asked, out.

    With `stream`, the requester also gets the tokens as they are generated
    (`InferChunk`s, in order) before the final `InferReply`, which has them all.
    """

    type: Literal["infer_request"] = "infer_request"
    serve_id: JobId = Field(pattern=JOB_ID_PATTERN)
    ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    new_tokens: int = Field(0, ge=0, le=MAX_NEW_TOKENS)
    logits: bool = Field(True, description="Return the output row (see InferReply.logits).")
    wait_s: float = Field(
        MAX_WAIT_S,
        gt=0,
        le=MAX_WAIT_S,
        description="Longest the requester waits for its turn: past it, the request is "
        "answered with how long it waited instead of being run.",
    )
    stream: bool = Field(False, description="Send InferChunks while generating.")


# --- coordinator -> operator -------------------------------------------------


Refusal = Literal["no_job", "busy", "late", "invalid", "ended", "failed"]
"""Why a request got no answer: no such serving job runs; its requester already has as
many waiting as it may (try again later); it waited past its `wait_s`; the model cannot
take it; the serving job ended before it ran; or it ran and the serving step failed."""


class InferReply(WireModel):
    """The answer to an InferRequest: generated tokens, the output row, and timings."""

    type: Literal["infer_reply"] = "infer_reply"
    serve_id: str
    request: int
    ok: bool
    error: str = ""
    tokens: list[int] = Field(default_factory=list)
    logits: list[float] = Field(
        default_factory=list,
        max_length=MAX_OUTPUT,
        description="A decoder's next-token logits after the prompt; an encoder's class "
        "logits, or its first position's hidden state without a classifier.",
    )
    latency_s: float = 0.0
    queued_s: float = 0.0
    finish_reason: Literal["stop", "length"] = Field(
        "length", description="`stop`: a stop token came (left out); `length`: new_tokens spent."
    )
    refusal: Refusal | None = Field(
        None, description="Why a request was not answered (ok false), for programs: see Refusal."
    )


class InferChunk(WireModel):
    """Tokens of a streamed request (`InferRequest.stream`) generated since the last chunk."""

    type: Literal["infer_chunk"] = "infer_chunk"
    serve_id: str
    request: int
    tokens: list[int] = Field(max_length=MAX_NEW_TOKENS)


# --- coordinator -> worker ---------------------------------------------------


class ProfileBlocks(WireModel):
    """Time the MHA, MLP and connective blocks here at these partition sizes."""

    type: Literal["profile_blocks"] = "profile_blocks"
    serve_id: JobId = Field(pattern=JOB_ID_PATTERN)
    epoch: int = Field(ge=0)
    model: TransformerShape
    seq_len: int = Field(ge=1, le=MAX_PROMPT_TOKENS)
    heads: list[int] = Field(min_length=1, max_length=MAX_PROFILE_POINTS)
    cols: list[int] = Field(min_length=1, max_length=MAX_PROFILE_POINTS)
    rows: list[int] = Field(min_length=1, max_length=MAX_PROFILE_POINTS)
    repeats: int = Field(3, ge=1, le=50)


class LoadShard(WireModel):
    """Load this device's shard of the served model under `plan` (ring order = plan.devices)."""

    type: Literal["load_shard"] = "load_shard"
    serve_id: JobId = Field(pattern=JOB_ID_PATTERN)
    epoch: int = Field(ge=0)
    spec: ServeSpec
    model: TransformerShape
    plan: InferencePlan
    peers: dict[DeviceId, str] = Field(
        max_length=64, description="Data-plane address of each device of the plan."
    )


class RunInference(Sampling):
    """Run request `round` on the loaded shard, with the ring's other devices.

    The ring's first device reports the tokens as they come (`InferenceProgress`).
    A request re-run after a device loss carries what was generated so far in
    `ids` and goes on at step `first_step`, so a seeded sample draws what the
    undisturbed run would have drawn.
    """

    type: Literal["run_inference"] = "run_inference"
    serve_id: JobId = Field(pattern=JOB_ID_PATTERN)
    epoch: int = Field(ge=0)
    round: int = Field(ge=1, description="The request's number, from 1.")
    ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    new_tokens: int = Field(0, ge=0, le=MAX_NEW_TOKENS)
    first_step: int = Field(
        0, ge=0, le=MAX_NEW_TOKENS, description="The decoding step the first new token is."
    )


# --- worker -> coordinator ---------------------------------------------------


class BlocksProfiled(WireModel):
    """A device's seconds per block at each partition size asked."""

    type: Literal["blocks_profiled"] = "blocks_profiled"
    device: DeviceId
    serve_id: str
    epoch: int
    round: int = Field(0, description="Serving step answered: 0 before any request.")
    profile: BlockProfile

    @field_validator("profile")
    @classmethod
    def _bounded(cls, profile: BlockProfile) -> BlockProfile:
        """A peer's profile holds no more points than were asked for at most."""
        for name in ("mha", "mlp", "con"):
            if len(getattr(profile, name)) > MAX_PROFILE_POINTS:
                raise ValueError(f"{name} has more than {MAX_PROFILE_POINTS} points")
        return profile


class ShardLoaded(WireModel):
    """The shard is in memory; `weight_bytes` of parameters."""

    type: Literal["shard_loaded"] = "shard_loaded"
    device: DeviceId
    serve_id: str
    epoch: int
    round: int = Field(0, description="Serving step answered: 0 before any request.")
    weight_bytes: int = Field(ge=0)
    load_s: float = Field(ge=0.0)


class InferenceDone(WireModel):
    """The ring's first device's output of a request (see InferReply for `logits`)."""

    type: Literal["inference_done"] = "inference_done"
    device: DeviceId
    serve_id: str
    epoch: int
    round: int = Field(description="The request answered (serving steps are numbered by request).")
    tokens: list[int] = Field(default_factory=list, max_length=MAX_NEW_TOKENS)
    logits: list[float] = Field(default_factory=list, max_length=MAX_OUTPUT)
    compute_s: float = Field(ge=0.0)


class InferenceProgress(WireModel):
    """Tokens the ring's first device generated for request `round` since its last report."""

    type: Literal["inference_progress"] = "inference_progress"
    device: DeviceId
    serve_id: str
    epoch: int
    round: int
    tokens: list[int] = Field(min_length=1, max_length=MAX_NEW_TOKENS)


# --- data plane: worker -> worker ---------------------------------------------


class HmpTile(WireModel):
    """One ring step's tile of hidden states (one tensor frame) for request `round`."""

    type: Literal["hmp_tile"] = "hmp_tile"
    serve_id: str = Field(pattern=JOB_ID_PATTERN)
    epoch: int = Field(ge=0)
    round: int = Field(ge=1, description="The request's number.")
    tag: str = Field(pattern=TAG_PATTERN)
