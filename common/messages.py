"""Every message of the control and data planes, as one discriminated union.

Messages are frozen pydantic models with a `type` tag; the codec puts them in
an envelope (sender, id, time, protocol version) and ships tensors as raw
frames after the header, never inside msgpack. Data-plane messages name their
plan epoch, round, micro-batch and stage so stale or duplicate frames are
recognised and dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from common.ids import DeviceId, JobId
from common.job import JOB_ID_PATTERN, JobSpec
from common.plan import Plan
from common.profile import ClusterSpec
from common.zoo import ModelSpec

__all__ = [
    "PROTOCOL_VERSION",
    "Activation",
    "Assign",
    "Assigned",
    "CancelJob",
    "CheckpointSaved",
    "EvalDone",
    "Gradient",
    "Heartbeat",
    "JobReply",
    "Message",
    "PlanReply",
    "PlanRequest",
    "Probe",
    "ProbeReply",
    "ProfileReply",
    "ProfileRequest",
    "ReduceChunk",
    "RoundDone",
    "RunEval",
    "RunRound",
    "SaveCheckpoint",
    "ServiceHello",
    "Shutdown",
    "StageTimings",
    "SubmitJob",
    "WorkerError",
    "message_adapter",
]

PROTOCOL_VERSION = 3
"""2: Assign names no Redis; each worker uses its own URL, so no credentials travel.
3: the coordinator probes suspects (Probe, ProbeReply); heartbeats carry progress."""


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- control plane: worker -> coordinator ---------------------------------


class Heartbeat(_Msg):
    """Liveness plus everything the coordinator needs to (re)register a worker."""

    type: Literal["heartbeat"] = "heartbeat"
    device: DeviceId
    data_addr: str
    memory_budget: int = Field(0, ge=0, description="Bytes left for training (0: unknown).")
    fingerprint: str = Field("", description="Device fingerprint its profiles are keyed by.")
    threads: int = 1
    host: str = Field("", description="Machine name; workers sharing one share its cores.")
    cores: int = Field(0, ge=0, description="Cores this worker's process may use.")
    cpu_quota: float = Field(0.0, ge=0, description="Its cgroup CPU quota in cores (0: none).")
    memory_configured: int = Field(
        0,
        ge=0,
        description="The --memory-budget it was started with (0: none); in its fingerprint.",
    )
    pid: int = 0
    epoch: int = 0
    stage: int = -1
    round: int = -1
    state: str = "idle"
    progress: int = Field(
        0,
        ge=0,
        description="Tasks its stage finished so far (forwards, backwards, all-reduce steps, "
        "optimizer steps): a count that stands still while the worker makes no progress.",
    )
    waiting: bool = Field(
        False,
        description="Its stage is blocked on the data plane, waiting for a peer (bounded by "
        "its task timeout): standing still then is the peer's doing, not a hang.",
    )


class Assigned(_Msg):
    """The worker built its stage for `epoch` and loaded weights of `round`."""

    type: Literal["assigned"] = "assigned"
    device: DeviceId
    epoch: int
    round: int
    param_bytes: int


class StageTimings(_Msg):
    """Where a worker's round time went, for metrics and the planner's feedback."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0
    allreduce_s: float = 0.0
    step_s: float = 0.0
    total_s: float = 0.0


class _StageOutcome(_Msg):
    """What a stage replica did with its samples; the last stage adds loss and hits."""

    device: DeviceId
    epoch: int
    round: int
    stage: int
    samples: int
    loss_sum: float = 0.0
    correct: int = 0


class RoundDone(_StageOutcome):
    """A worker finished a round: gradients reduced and the optimizer stepped.

    `peak_bytes` is the most the worker held at once for the round (tensors in
    its task pool plus activations saved for backward); `peak_saved_bytes` is
    the saved activations' own peak, which the schedule bounds by K_p micro-batches.
    """

    type: Literal["round_done"] = "round_done"
    max_alive: int = 0
    peak_bytes: int = Field(0, ge=0)
    peak_saved_bytes: int = Field(0, ge=0)
    timings: StageTimings = StageTimings()


class EvalDone(_StageOutcome):
    """A worker ran its part of the held-out evaluation of the weights of round `round`.

    `loss_sum` is per-sample cross-entropy summed (not averaged) over `samples`.
    """

    type: Literal["eval_done"] = "eval_done"


class CheckpointSaved(_Msg):
    """A device's part of checkpoint `round`: the layers it wrote and its state's digest.

    The stage leader writes the layers (the others list none); every replica
    sends the SHA-256 of its stage's state so the coordinator can compare them.
    """

    type: Literal["checkpoint_saved"] = "checkpoint_saved"
    device: DeviceId
    epoch: int
    round: int
    layers: list[int]
    stage: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


class ProbeReply(_Msg):
    """The worker's control thread answers a Probe at once, whatever its stage is doing."""

    type: Literal["probe_reply"] = "probe_reply"
    device: DeviceId
    nonce: int


class WorkerError(_Msg):
    """A worker could not do what it was asked; the text says why."""

    type: Literal["worker_error"] = "worker_error"
    device: DeviceId
    epoch: int
    round: int
    error: str


# --- control plane: coordinator -> worker ----------------------------------


class Assign(_Msg):
    """Run stage `stage` of `plan` from the weights of checkpoint `from_round`.

    Re-sent with a new epoch to move a worker to other layers without restarting it.
    Names no Redis: the worker reads and writes checkpoints through its own
    configured Redis URL and cluster, so no credentials travel on the control plane.
    """

    type: Literal["assign"] = "assign"
    epoch: int
    job: JobSpec
    plan: Plan
    stage: int
    peers: dict[str, str]
    from_round: int
    total_rounds: int = Field(0, ge=0, description="Rounds of the job, for the lr schedule.")


class RunRound(_Msg):
    """Start round `round` (0-based) of plan epoch `epoch`."""

    type: Literal["run_round"] = "run_round"
    epoch: int
    round: int


class RunEval(_Msg):
    """Evaluate the weights of round `round` on `batches` global batches of held-out data.

    Forward only, through the same pipeline as training; nothing is updated.
    """

    type: Literal["run_eval"] = "run_eval"
    epoch: int
    round: int
    batches: int = Field(ge=1)


class SaveCheckpoint(_Msg):
    """Write this stage's layers (weights and optimizer state) as checkpoint `round`."""

    type: Literal["save_checkpoint"] = "save_checkpoint"
    epoch: int
    round: int


class Probe(_Msg):
    """Are you there? Sent to a worker whose heartbeats are overdue; `nonce` pairs the reply.

    Only an unanswered probe makes a suspect dead: a heartbeat lost or late on
    its way must not fail a device that is still there.
    """

    type: Literal["probe"] = "probe"
    nonce: int


class Shutdown(_Msg):
    """Stop the worker process cleanly."""

    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


# --- control plane: services ----------------------------------------------------


class ServiceHello(_Msg):
    """A planner or profiler service announcing itself (and staying alive)."""

    type: Literal["service_hello"] = "service_hello"
    service: str
    pid: int = 0
    host: str = ""


class ProfileRequest(_Msg):
    """Profile `model` as a worker with this fingerprint runs it, unless cached.

    A profiler accepts only when its own fingerprint for (`threads`,
    `memory_budget`) equals `fingerprint`: a profile must come from the same
    kind of device as the worker that will use it.
    """

    type: Literal["profile_request"] = "profile_request"
    job_id: str
    model: ModelSpec
    fingerprint: str
    threads: int = Field(ge=1)
    memory_budget: int = Field(0, ge=0)
    batch_sizes: list[int] = Field(default_factory=list)
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"


class ProfileReply(_Msg):
    """The profile is in Redis under `profile:<key>`; or `error` (`mine` False: wrong device)."""

    type: Literal["profile_reply"] = "profile_reply"
    job_id: str
    fingerprint: str
    ok: bool
    mine: bool = True
    key: str = ""
    error: str = ""
    seconds: float = 0.0


class SubmitJob(_Msg):
    """A person (through the CLI) asks the coordinator to run a job."""

    type: Literal["submit_job"] = "submit_job"
    job: JobSpec
    replace: bool = Field(False, description="Start afresh if a finished job has this id.")


class CancelJob(_Msg):
    """Stop a submitted or running job; its last committed checkpoint stays."""

    type: Literal["cancel_job"] = "cancel_job"
    job_id: JobId = Field(pattern=JOB_ID_PATTERN, description="The job to stop.")
    reason: str = Field("cancelled by request", max_length=500)


class JobReply(_Msg):
    """The coordinator's answer to SubmitJob or CancelJob."""

    type: Literal["job_reply"] = "job_reply"
    job_id: str
    ok: bool
    error: str = ""


class PlanRequest(_Msg):
    """Ask the planner for a plan of `job_id`; it stores the plan in Redis."""

    type: Literal["plan_request"] = "plan_request"
    job_id: str
    planner: str
    cluster: ClusterSpec
    profiles: list[str] = Field(description="Redis keys of the profiles the cluster names.")
    global_batch: int
    microbatches: int


class PlanReply(_Msg):
    """The planner's answer: the plan is in Redis under `plan:<job_id>`, or `error`."""

    type: Literal["plan_reply"] = "plan_reply"
    job_id: str
    ok: bool
    error: str = ""
    predicted_round_s: float = 0.0


# --- data plane: worker -> worker -------------------------------------------


class _SampleRange(_Msg):
    """Samples [lo, hi) of micro-batch `mb` of a round, addressed to `stage`."""

    epoch: int
    round: int
    mb: int
    stage: int
    lo: int
    hi: int


class Activation(_SampleRange):
    """Outputs of stage-1 for samples [lo, hi) of micro-batch `mb`, input of `stage`.

    Frames: the activation tensor, then the labels of the same samples.
    """

    type: Literal["activation"] = "activation"
    phase: Literal["train", "eval"] = "train"


class Gradient(_SampleRange):
    """Loss gradient w.r.t. the outputs of `stage` for samples [lo, hi) of `mb`.

    Frames: one gradient tensor.
    """

    type: Literal["gradient"] = "gradient"


class ReduceChunk(_Msg):
    """One chunk of a ring all-reduce step inside a stage's group. Frames: the chunk."""

    type: Literal["reduce_chunk"] = "reduce_chunk"
    epoch: int
    round: int
    stage: int
    step: int
    chunk: int


Message = Annotated[
    Heartbeat
    | Assigned
    | RoundDone
    | CheckpointSaved
    | WorkerError
    | Assign
    | RunRound
    | SaveCheckpoint
    | RunEval
    | EvalDone
    | Shutdown
    | Probe
    | ProbeReply
    | ServiceHello
    | PlanRequest
    | PlanReply
    | ProfileRequest
    | ProfileReply
    | SubmitJob
    | CancelJob
    | JobReply
    | Activation
    | Gradient
    | ReduceChunk,
    Field(discriminator="type"),
]

message_adapter: TypeAdapter[Message] = TypeAdapter(Message)
