"""Every message of the control and data planes, as one discriminated union.

Messages are frozen pydantic models with a `type` tag; the codec puts them in
an envelope (sender, id, time, protocol version) and ships tensors as raw
frames after the header, never inside msgpack. Data-plane messages name their
plan epoch, round, micro-batch and stage so stale or duplicate frames are
recognised and dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.ids import DeviceId, JobId
from common.job import JOB_ID_PATTERN, JobSpec
from common.message_base import WireModel
from common.plan import Plan
from common.profile import ClusterSpec
from common.serving_messages import (
    BlocksProfiled,
    HmpTile,
    InferChunk,
    InferenceDone,
    InferenceProgress,
    InferReply,
    InferRequest,
    LoadShard,
    ProfileBlocks,
    RunInference,
    ServeModel,
    ShardLoaded,
)
from common.zoo import ModelSpec

__all__ = [
    "PROTOCOL_VERSION",
    "Activation",
    "Assign",
    "Assigned",
    "CancelJob",
    "CheckpointSaved",
    "Collect",
    "DrainDevice",
    "EvalDone",
    "Gradient",
    "Handover",
    "Heartbeat",
    "JobReply",
    "LayerState",
    "LinkData",
    "LinkDone",
    "LinkHello",
    "LinkReady",
    "LinksMeasured",
    "LocateRedis",
    "MeasureLinks",
    "Message",
    "PeerDown",
    "PlanReply",
    "PlanRequest",
    "Probe",
    "ProbeReply",
    "ProfileReply",
    "ProfileRequest",
    "RedisLocation",
    "ReduceChunk",
    "ReplicaSaved",
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

PROTOCOL_VERSION = 9
"""2: Assign names no Redis; each worker uses its own URL, so no credentials travel.
3: the coordinator probes suspects (Probe, ProbeReply); heartbeats carry progress.
4: replicas and layer migration (LayerState, ReplicaSaved, Collect; RunRound keeps
versions, Assign names the peers layers come from).
5: measured links (heartbeats advertise a bandwidth sink; MeasureLinks, LinksMeasured,
and the probe's own LinkHello, LinkReady, LinkData, LinkDone).
6: heartbeats carry the worker's release; devices ask the coordinator where Redis is
(LocateRedis, RedisLocation: host, port, db, never a password).
7: serving (`common.serving_messages`): a model planned and loaded across devices answers
inference requests; its ring's tiles travel as HmpTile.
8: federated learning (`common.federation_messages`): homes' coordinators and the
federation service (JoinFederation, FetchModel, FederatedModel, HomeUpdate, FederationReply).
9: workers report a lost neighbour (PeerDown); an Assign may bound how long a worker
waits for a neighbour's data before it says so (peer_timeout_s)."""

MAX_LAYERS = 100_000
"""Most layers a message may name: far above any model, so only a hostile list hits it."""
MAX_KEPT = 64
"""Most versions a worker is told to keep."""
MAX_LINK_TARGETS = 64
"""Most sinks one MeasureLinks names (and so most rates or errors one LinksMeasured carries)."""
MAX_LINK_COUNT = 1_000_000
"""Most payload messages one bandwidth probe announces."""
MAX_LINK_MESSAGE_BYTES = 64 << 20
"""Largest payload of one bandwidth probe message."""
MAX_LINK_TIMEOUT_S = 600.0
"""Longest a coordinator may let a worker spend probing one sink."""
PROBE_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
RELEASE_PATTERN = r"^[A-Za-z0-9_.+!-]{0,64}$"
"""A release (PEP 440, local part included): short, and nothing a log line would mangle."""
HOST_PATTERN = r"^[A-Za-z0-9_.:-]{0,253}$"
"""A host name, an IPv4 or a bare IPv6 address (no brackets); empty where a default applies."""
CLUSTER_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
"""A cluster's key prefix as the coordinator may name it to devices."""
ENDPOINT_PATTERN = r"^tcp://[^\s/]{1,250}$"
"""A ZeroMQ TCP endpoint ("tcp://host:port"), the only kind a worker is asked to probe."""
_LinkPeer = Annotated[DeviceId, Field(min_length=1, max_length=255)]
MAX_DEVICE_THREADS = 1024
"""Most threads, cores or quota a device may claim: above any board or laptop this serves."""
MAX_DEVICE_MEMORY = 16 << 40
"""Most memory (16 TiB) a device may claim; beyond it a claim is a lie, not a machine."""
MAX_ADDR_CHARS = 256
"""Longest address or host name a heartbeat may carry."""
FINGERPRINT_PATTERN = r"^[A-Za-z0-9_.+-]{0,160}$"
"""A device fingerprint (`common.device.device_fingerprint`): short, log-safe."""
MAX_PEER_WAIT_S = 1e6
"""A PeerDown's `waited_s` is below this: about eleven days, beyond any round."""
MAX_PEER_TIMEOUT_S = 1e5
"""Longest neighbour timeout a coordinator may set (about a day); beyond it, none is meant."""


# --- control plane: worker -> coordinator ---------------------------------


class Heartbeat(WireModel):
    """Liveness plus everything the coordinator needs to (re)register a worker."""

    type: Literal["heartbeat"] = "heartbeat"
    device: DeviceId
    data_addr: str = Field(max_length=MAX_ADDR_CHARS)
    memory_budget: int = Field(
        0, ge=0, le=MAX_DEVICE_MEMORY, description="Bytes left for training (0: unknown)."
    )
    fingerprint: str = Field(
        "",
        pattern=FINGERPRINT_PATTERN,
        description="Device fingerprint its profiles are keyed by.",
    )
    threads: int = Field(1, ge=1, le=MAX_DEVICE_THREADS)
    host: str = Field(
        "",
        max_length=MAX_ADDR_CHARS,
        description="Machine name; workers sharing one share its cores.",
    )
    cores: int = Field(
        0, ge=0, le=MAX_DEVICE_THREADS, description="Cores this worker's process may use."
    )
    cpu_quota: float = Field(
        0.0, ge=0, le=MAX_DEVICE_THREADS, description="Its cgroup CPU quota in cores (0: none)."
    )
    memory_configured: int = Field(
        0,
        ge=0,
        le=MAX_DEVICE_MEMORY,
        description="The --memory-budget it was started with (0: none); in its fingerprint.",
    )
    pid: int = Field(0, ge=0, le=1 << 32)
    epoch: int = Field(0, ge=0, le=1 << 62)
    stage: int = Field(-1, ge=-1, le=MAX_LAYERS)
    round: int = Field(-1, ge=-1, le=1 << 62)
    state: str = Field("idle", pattern=r"^[a-z_]{1,32}$")
    progress: int = Field(
        0,
        ge=0,
        le=1 << 62,
        description="Tasks its stage finished so far (forwards, backwards, all-reduce steps, "
        "optimizer steps): a count that stands still while the worker makes no progress.",
    )
    waiting: bool = Field(
        False,
        description="Its stage is blocked on the data plane, waiting for a peer (bounded by "
        "its task timeout): standing still then is the peer's doing, not a hang.",
    )
    link_addr: str = Field(
        "",
        max_length=256,
        description="Where its bandwidth sink listens, for peers measuring their link to it "
        "(empty: it runs none).",
    )
    version: str = Field(
        "",
        pattern=RELEASE_PATTERN,
        description="The worker's release (`common.version.VERSION`; empty: not told), "
        "compared with the coordinator's so a device left on an older release is named.",
    )


class Assigned(WireModel):
    """The worker built its stage for `epoch` and loaded weights of `round`."""

    type: Literal["assigned"] = "assigned"
    device: DeviceId
    epoch: int
    round: int
    param_bytes: int


class StageTimings(WireModel):
    """Where a worker's round time went, for metrics and the planner's feedback."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0
    allreduce_s: float = 0.0
    step_s: float = 0.0
    total_s: float = 0.0


class _StageOutcome(WireModel):
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


class CheckpointSaved(WireModel):
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


class LocateRedis(WireModel):
    """Where is the cluster's Redis? Asked by a device (or the CLI) given no Redis URL.

    Any key of the set may ask: the answer holds no credential, which each
    device reads from its own key set (`common.locate`).
    """

    type: Literal["locate_redis"] = "locate_redis"
    nonce: int = Field(ge=0, lt=2**63)


class ProbeReply(WireModel):
    """The worker's control thread answers a Probe at once, whatever its stage is doing."""

    type: Literal["probe_reply"] = "probe_reply"
    device: DeviceId
    nonce: int


class ReplicaSaved(WireModel):
    """`device` holds a complete replica of `origin`'s layers [start, end) at `version`.

    Sent by a backup node once every layer of the replica arrived, so the
    coordinator knows which versions a lost stage can be restored from.
    """

    type: Literal["replica_saved"] = "replica_saved"
    device: DeviceId
    epoch: int
    version: int = Field(ge=0)
    origin: DeviceId
    start: int = Field(ge=0)
    end: int = Field(ge=1)


class LinksMeasured(WireModel):
    """The answer to MeasureLinks `nonce`: bytes/s to each sink, or why it failed.

    Every target named by the request is in exactly one of `rates` and `errors`.
    """

    type: Literal["links_measured"] = "links_measured"
    device: DeviceId
    nonce: int = Field(ge=0)
    rates: dict[_LinkPeer, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=MAX_LINK_TARGETS
    )
    errors: dict[_LinkPeer, Annotated[str, Field(max_length=500)]] = Field(
        default_factory=dict, max_length=MAX_LINK_TARGETS
    )


class PeerDown(WireModel):
    """Evidence that `peer`, a neighbour of `device` in plan `epoch`, is lost (or is back).

    "disconnected": the data connection to the peer closed (its process died,
    so the kernel closed its sockets); "reconnected": it came back after one;
    "silent": `device` waited `waited_s` for the peer's data, longer than the
    Assign's `peer_timeout_s`. Evidence only: the coordinator decides a loss
    (a connection that comes back within its grace is none).
    """

    type: Literal["peer_down"] = "peer_down"
    device: DeviceId = Field(min_length=1, max_length=255)
    epoch: int = Field(ge=0, le=1 << 62)
    peer: DeviceId = Field(min_length=1, max_length=255)
    how: Literal["disconnected", "reconnected", "silent"]
    waited_s: float = Field(
        0.0,
        ge=0.0,
        lt=MAX_PEER_WAIT_S,
        allow_inf_nan=False,
        description='For "silent": how long it waited for the peer\'s data; else 0.',
    )


class WorkerError(WireModel):
    """A worker could not do what it was asked; the text says why."""

    type: Literal["worker_error"] = "worker_error"
    device: DeviceId
    epoch: int
    round: int
    error: str


# --- control plane: coordinator -> worker ----------------------------------


class Assign(WireModel):
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
    sources: dict[int, DeviceId] | None = Field(
        None,
        max_length=MAX_LAYERS,
        description="Layers of the stage this device did not hold, and the peer sending each "
        "(version from_round); layers it held come from its own copy. None: all from Redis.",
    )
    sends: dict[DeviceId, list[int]] = Field(
        default_factory=dict,
        max_length=MAX_LAYERS,
        description="Layers (version from_round) this device sends to each peer before it "
        "loads its own.",
    )
    peer_timeout_s: float | None = Field(
        None,
        gt=0.0,
        le=MAX_PEER_TIMEOUT_S,
        allow_inf_nan=False,
        description="Waiting longer than this for a neighbour's data, the worker reports "
        "PeerDown silent (once per round and peer) and keeps waiting. None: it never does.",
    )


class RunRound(WireModel):
    """Start round `round` (0-based) of plan epoch `epoch`.

    `keep` names the versions of stage state the worker must keep (its own
    snapshots and the replicas it holds): those a recovery may resume from.
    With `replicate`, the state at the start of this round is a replication
    version: every device keeps it and a single-device stage sends it to its
    backup node, on the data plane behind the round's own traffic.
    """

    type: Literal["run_round"] = "run_round"
    epoch: int
    round: int
    keep: list[int] = Field(default_factory=list, max_length=MAX_KEPT)
    replicate: bool = False


class RunEval(WireModel):
    """Evaluate the weights of round `round` on `batches` global batches of held-out data.

    Forward only, through the same pipeline as training; nothing is updated.
    """

    type: Literal["run_eval"] = "run_eval"
    epoch: int
    round: int
    batches: int = Field(ge=1)


class SaveCheckpoint(WireModel):
    """Write this stage's layers (weights and optimizer state) as checkpoint `round`."""

    type: Literal["save_checkpoint"] = "save_checkpoint"
    epoch: int
    round: int


class Collect(WireModel):
    """Write the layers this device holds at `version` to Redis as checkpoint `version`.

    The heavy recovery's gather through the central store: its own stage's
    layers and any replica's. Abandons the round in flight, like an Assign.
    Answered with CheckpointSaved.
    """

    type: Literal["collect"] = "collect"
    epoch: int
    version: int = Field(ge=0)
    layers: list[int] = Field(max_length=MAX_LAYERS)


class Handover(WireModel):
    """Send peers the layers this device holds at `version`; it is leaving the plan.

    A drained device is not in the new plan, yet it may be the only holder of
    layers the new plan places elsewhere: it sends them as a device of the plan
    does (`Assign.sends`), before it is let go. Not answered: a receiver that
    waits in vain fails its Assign, and the job recovers as from a loss.
    """

    type: Literal["handover"] = "handover"
    epoch: int
    version: int = Field(ge=0)
    peers: dict[str, str] = Field(max_length=MAX_LINK_TARGETS)
    sends: dict[DeviceId, list[int]] = Field(max_length=MAX_LINK_TARGETS)


class RedisLocation(WireModel):
    """The coordinator's answer to LocateRedis `nonce`: host, port, db and key prefix.

    Never a password or user: a device connects as its role's Redis user with
    the password from its own key set. An empty `host` means the coordinator's
    own host as the device reaches it (the coordinator's Redis is on its
    loopback); `error` says why there is no location (`port` then means nothing).
    """

    type: Literal["redis_location"] = "redis_location"
    nonce: int = Field(ge=0, lt=2**63)
    host: str = Field("", pattern=HOST_PATTERN)
    port: int = Field(6379, ge=1, le=65535)
    db: int = Field(0, ge=0, le=65535)
    tls: bool = Field(False, description="Connect with TLS (rediss://).")
    cluster: str = Field("default", pattern=CLUSTER_PATTERN)
    error: str = Field("", max_length=500)


class Probe(WireModel):
    """Are you there? Sent to a worker whose heartbeats are overdue; `nonce` pairs the reply.

    Only an unanswered probe makes a suspect dead: a heartbeat lost or late on
    its way must not fail a device that is still there.
    """

    type: Literal["probe"] = "probe"
    nonce: int


class MeasureLinks(WireModel):
    """Measure the bandwidth from this worker to each target device's sink, one after another.

    Each probe streams `count` messages of `nbytes` and takes at most `timeout_s`;
    answered with LinksMeasured `nonce`. The worker probes beside its stage, so
    it keeps heartbeating (the coordinator asks between rounds only).
    """

    type: Literal["measure_links"] = "measure_links"
    nonce: int = Field(ge=0)
    targets: dict[_LinkPeer, Annotated[str, Field(pattern=ENDPOINT_PATTERN)]] = Field(
        min_length=1, max_length=MAX_LINK_TARGETS
    )
    nbytes: int = Field(ge=1, le=MAX_LINK_MESSAGE_BYTES)
    count: int = Field(ge=1, le=MAX_LINK_COUNT)
    timeout_s: float = Field(gt=0, le=MAX_LINK_TIMEOUT_S)


class Shutdown(WireModel):
    """Stop the worker process cleanly."""

    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


# --- control plane: services ----------------------------------------------------


class ServiceHello(WireModel):
    """A planner or profiler service announcing itself (and staying alive)."""

    type: Literal["service_hello"] = "service_hello"
    service: str
    pid: int = 0
    host: str = ""


class ProfileRequest(WireModel):
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


class ProfileReply(WireModel):
    """The profile is in Redis under `profile:<key>`; or `error` (`mine` False: wrong device)."""

    type: Literal["profile_reply"] = "profile_reply"
    job_id: str
    fingerprint: str
    ok: bool
    mine: bool = True
    key: str = ""
    error: str = ""
    seconds: float = 0.0


class SubmitJob(WireModel):
    """A person (through the CLI) asks the coordinator to run a job."""

    type: Literal["submit_job"] = "submit_job"
    job: JobSpec
    replace: bool = Field(False, description="Start afresh if a finished job has this id.")


class CancelJob(WireModel):
    """Stop a submitted or running job; its last committed checkpoint stays."""

    type: Literal["cancel_job"] = "cancel_job"
    job_id: JobId = Field(pattern=JOB_ID_PATTERN, description="The job to stop.")
    reason: str = Field("cancelled by request", max_length=500)


class DrainDevice(WireModel):
    """Move a device's work away at the next round boundary (nothing replayed), then let it go."""

    type: Literal["drain_device"] = "drain_device"
    target: DeviceId = Field(
        max_length=255,
        description="The device to drain (not `device`: that names a message's own sender).",
    )
    reason: str = Field("drained by request", max_length=500)


class JobReply(WireModel):
    """The coordinator's answer to SubmitJob or CancelJob."""

    type: Literal["job_reply"] = "job_reply"
    job_id: str
    ok: bool
    error: str = ""


class PlanRequest(WireModel):
    """Ask the planner for a plan of `job_id`; it stores the plan in Redis."""

    type: Literal["plan_request"] = "plan_request"
    job_id: str
    planner: str
    cluster: ClusterSpec
    profiles: list[str] = Field(description="Redis keys of the profiles the cluster names.")
    global_batch: int
    microbatches: int
    current: Plan | None = Field(
        None, description="The running plan, to predict on this cluster too (a re-plan's baseline)."
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="The job's training mode (async stages stash weight versions)."
    )
    aggregate_every: int = Field(0, ge=0, description="The job's async aggregation interval.")


class PlanReply(WireModel):
    """The planner's answer: the plan itself, or `error`.

    The plan travels in the reply: the coordinator, which asked, records the plan a
    job runs on (`plan:<job_id>`), so Redis is never a mailbox between the two.
    """

    type: Literal["plan_reply"] = "plan_reply"
    job_id: str
    ok: bool
    error: str = ""
    plan: Plan | None = None
    predicted_round_s: float = 0.0
    current_round_s: float = Field(
        0.0, ge=0.0, description="The request's `current` plan's predicted round; 0: not asked."
    )


# --- data plane: worker -> worker -------------------------------------------


class _SampleRange(WireModel):
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


class LayerState(WireModel):
    """One layer's state (weights, buffers, optimizer state) at `version`.

    Frames: one uint8 tensor, the layer's safetensors blob (parsed, never
    executed). `purpose` "replica": a backup of the sender's stage, layers
    [start, end); "migrate": a layer the receiver's new stage needs.
    """

    type: Literal["layer_state"] = "layer_state"
    epoch: int
    version: int = Field(ge=0)
    layer: int = Field(ge=0)
    purpose: Literal["replica", "migrate"]
    start: int = Field(0, ge=0)
    end: int = Field(0, ge=0)


class ReduceChunk(WireModel):
    """One chunk of a ring all-reduce step inside a stage's group. Frames: the chunk."""

    type: Literal["reduce_chunk"] = "reduce_chunk"
    epoch: int
    round: int
    stage: int
    step: int
    chunk: int


# --- bandwidth probe: worker -> a peer's bandwidth sink ------------------------------


class LinkHello(WireModel):
    """A prober announces probe `probe`: `count` messages of `nbytes` follow."""

    type: Literal["link_hello"] = "link_hello"
    probe: str = Field(pattern=PROBE_ID_PATTERN)
    count: int = Field(ge=1, le=MAX_LINK_COUNT)
    nbytes: int = Field(ge=1, le=MAX_LINK_MESSAGE_BYTES)


class LinkReady(WireModel):
    """The sink tracks probe `probe` now; the prober may stream."""

    type: Literal["link_ready"] = "link_ready"
    probe: str = Field(pattern=PROBE_ID_PATTERN)
    count: int = Field(ge=1, le=MAX_LINK_COUNT)
    nbytes: int = Field(ge=1, le=MAX_LINK_MESSAGE_BYTES)


class LinkData(WireModel):
    """Payload message `seq` of probe `probe`. Frames: one uint8 tensor of the announced size."""

    type: Literal["link_data"] = "link_data"
    probe: str = Field(pattern=PROBE_ID_PATTERN)
    seq: int = Field(ge=0, lt=MAX_LINK_COUNT)


class LinkDone(WireModel):
    """The sink received all `count` messages of probe `probe`, `nbytes` bytes in all."""

    type: Literal["link_done"] = "link_done"
    probe: str = Field(pattern=PROBE_ID_PATTERN)
    count: int = Field(ge=1, le=MAX_LINK_COUNT)
    nbytes: int = Field(ge=1)


Message = Annotated[
    Heartbeat
    | Assigned
    | RoundDone
    | CheckpointSaved
    | WorkerError
    | PeerDown
    | ReplicaSaved
    | Collect
    | Handover
    | Assign
    | RunRound
    | SaveCheckpoint
    | RunEval
    | EvalDone
    | Shutdown
    | Probe
    | ProbeReply
    | LocateRedis
    | RedisLocation
    | ServiceHello
    | PlanRequest
    | PlanReply
    | ProfileRequest
    | ProfileReply
    | SubmitJob
    | CancelJob
    | DrainDevice
    | JobReply
    | Activation
    | Gradient
    | ReduceChunk
    | LayerState
    | MeasureLinks
    | LinksMeasured
    | LinkHello
    | LinkReady
    | LinkData
    | LinkDone
    | ServeModel
    | InferRequest
    | InferReply
    | InferChunk
    | ProfileBlocks
    | LoadShard
    | RunInference
    | BlocksProfiled
    | ShardLoaded
    | InferenceDone
    | InferenceProgress
    | HmpTile
    | JoinFederation
    | FetchModel
    | FederatedModel
    | HomeUpdate
    | FederationReply,
    Field(discriminator="type"),
]

message_adapter: TypeAdapter[Message] = TypeAdapter(Message)
