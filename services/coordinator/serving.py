"""A serving job from `ServeModel` to its cancel: profile, plan, load, then answer requests.

Galaxy's workflow (§III-A) on our services: every device times the
Transformer blocks at a few partition sizes (its profiler phase), the planner
of the job's mode splits heads, MLP columns and sequence rows under each
device's memory budget (Algorithm 1 for `galaxy`), every device loads its
shard, and then requests are run one at a time, in arrival order, on all
devices at once; the rest wait in a bounded queue. Each answer records its
latency in the job's `metrics` stream. The job ends when cancelled (its normal
end) or when a device fails; training jobs queued meanwhile wait for it.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from pydantic import ValidationError

from common.errors import AsteroidError, ConfigError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from common.ids import DeviceId
from common.lifecycle import JobState, advance
from common.logging import bind_global, get_logger
from common.secrets import mask_text
from common.serving_messages import (
    BlocksProfiled,
    InferenceDone,
    InferReply,
    InferRequest,
    LoadShard,
    ProfileBlocks,
    RunInference,
    ServeSpec,
    ShardLoaded,
    TransformerShape,
)
from services.coordinator.galaxy.planner import (
    plan_galaxy,
    plan_local,
    plan_megatron,
    plan_sp,
    require_capacity,
)
from services.coordinator.host import Host
from services.coordinator.infer_requests import PendingRequest
from services.coordinator.jobs import JobCancelled, JobFailed
from services.lib.galaxy.sources import from_checkpoint

__all__ = ["PendingRequest", "ServeRun", "profile_sizes", "refusal"]

log = get_logger(__name__)

JOIN_TIMEOUT_S = 60.0
"""How long the devices of a serving job get to be heard from."""
LOAD_TIMEOUT_S = 300.0
"""How long profiling, or loading a shard, may take on every device."""
REQUEST_TIMEOUT_S = 600.0
"""Longest one request may run on the devices."""


def refusal(config: TransformerConfig, msg: InferRequest) -> str | None:
    """Why the served model cannot answer `msg` (it is refused, the job goes on), or None."""
    if msg.new_tokens and config.kind != "decoder":
        return "only a decoder generates tokens; this model is an encoder"
    bad = [t for t in msg.ids if not 0 <= t < config.vocab_size]
    if bad:
        return f"token ids must be in [0, {config.vocab_size}), got {bad[:5]}"
    if len(msg.ids) + msg.new_tokens > config.max_positions:
        return (
            f"{len(msg.ids)} tokens plus {msg.new_tokens} to generate exceed the model's "
            f"{config.max_positions} positions"
        )
    return None


def profile_sizes(total: int, points: int = 4) -> list[int]:
    """Partition sizes to time a block at: `points` sizes spread over 1..total."""
    sizes = {max(1, round(total * (i + 1) / points)) for i in range(points)}
    return sorted(sizes)


class ServeRun:
    """One serving job on the coordinator's socket; `run` returns when it ends."""

    def __init__(self, coord: Host, spec: ServeSpec) -> None:
        self.coord = coord
        self.spec = spec
        self.state: JobState = "submitted"
        self.epoch = int(time.time() * 1000) % (2**31)
        """Tells this job's replies and tiles from any earlier job's."""
        self.requests = 0

    def run(self) -> None:
        """Serve until cancelled or a device fails; every ending is recorded in Redis."""
        jid = self.spec.serve_id
        self.coord.running = jid
        bind_global(job=jid)
        try:
            devices = self._devices()
            self.coord.wait_for_devices(devices, JOIN_TIMEOUT_S)
            shape = self._shape()
            config = shape.config()
            require_capacity(config, self._budgets(devices), self.spec.seq_len)
            self._advance("profiling")
            profiles = self._profile(devices, shape)
            self._advance("planning")
            plan = self._plan(config, devices, profiles)
            self._load(plan, shape)
            self._advance("running", plan=plan.model_dump(mode="json"))
            log.info(
                "serving", mode=plan.mode, devices=plan.devices, heads=plan.heads, cols=plan.cols
            )
            self._answer(plan, config)
        except JobCancelled as exc:
            self._advance("cancelled", reason=str(exc))
        except (AsteroidError, ValidationError) as exc:
            error = mask_text(str(exc))
            log.error("serving job failed", error=error)
            self._advance("failed", error=error)
            self._refuse_waiting(error)
        finally:
            self.coord.running = None
            self.coord.assigned = frozenset()
            bind_global(job=None)

    def _advance(self, to: JobState, **extra: Any) -> None:
        self.state = advance(self.state, to)
        self.coord.durable(
            f"serving job {self.spec.serve_id} {to}",
            lambda: self.coord.write_state(self.spec.serve_id, to, **extra),
        )

    def _devices(self) -> list[DeviceId]:
        if self.spec.devices:
            return list(self.spec.devices)
        alive = sorted(self.coord.alive())
        if not alive:
            raise JobFailed("no worker is connected to serve on")
        return alive

    def _shape(self) -> TransformerShape:
        """The served shape; a checkpoint's is read from it, and its round pinned."""
        if self.spec.model is not None:
            return self.spec.model
        if self.spec.job is None:  # the spec's validator makes this unreachable
            raise ConfigError(f"serving job {self.spec.serve_id} names no model and no job")
        config, _, chosen = from_checkpoint(self.coord.store, self.spec.job, self.spec.round)
        self.spec = self.spec.model_copy(update={"round": chosen})
        log.info("serving a checkpoint", trained_by=self.spec.job, round=chosen)
        return TransformerShape.of(config)

    def _profile(self, devices: list[DeviceId], shape: TransformerShape) -> dict[str, BlockProfile]:
        """Every device times the blocks at the sizes a plan may give it."""
        msg = ProfileBlocks(
            serve_id=self.spec.serve_id,
            epoch=self.epoch,
            model=shape,
            seq_len=self.spec.seq_len,
            heads=profile_sizes(shape.heads),
            cols=profile_sizes(shape.ffn),
            rows=profile_sizes(self.spec.seq_len),
        )
        for d in devices:
            self.coord.send(d, msg)
        replies = self.coord.gather(BlocksProfiled, devices, self.epoch, 0, LOAD_TIMEOUT_S)
        profiles: dict[str, BlockProfile] = {}
        for d, reply in replies.items():
            if reply.profile.seq_len != self.spec.seq_len:
                raise JobFailed(
                    f"device {d} profiled seq_len {reply.profile.seq_len}, "
                    f"asked {self.spec.seq_len}"
                )
            profiles[d] = reply.profile
        return profiles

    def _budgets(self, devices: list[DeviceId]) -> dict[str, int]:
        """Each device's memory for its shard: what its heartbeat says training may use."""
        return {d: self.coord.members[d].info.memory_budget for d in devices}

    def _plan(
        self, config: TransformerConfig, devices: list[DeviceId], profiles: dict[str, BlockProfile]
    ) -> InferencePlan:
        budgets = self._budgets(devices)
        seq = self.spec.seq_len
        names = [str(d) for d in devices]
        if self.spec.mode == "galaxy":
            return plan_galaxy(config, names, profiles, budgets, seq, overlap=self.spec.overlap)
        if self.spec.mode == "megatron":
            return plan_megatron(config, names, seq, budgets)
        if self.spec.mode == "sp":
            return plan_sp(config, names, seq, budgets)
        return plan_local(config, names, profiles, budgets, seq)

    def _load(self, plan: InferencePlan, shape: TransformerShape) -> None:
        devices = [DeviceId(d) for d in plan.devices]
        self.coord.assigned = frozenset(devices)
        peers = {d: self.coord.members[d].info.data_addr for d in devices}
        for d in devices:
            self.coord.send(
                d,
                LoadShard(
                    serve_id=self.spec.serve_id,
                    epoch=self.epoch,
                    spec=self.spec,
                    model=shape,
                    plan=plan,
                    peers=peers,
                ),
            )
        loaded = self.coord.gather(ShardLoaded, devices, self.epoch, 0, LOAD_TIMEOUT_S)
        log.info("shards loaded", weight_bytes={d: m.weight_bytes for d, m in loaded.items()})

    def _answer(self, plan: InferencePlan, config: TransformerConfig) -> None:
        """Run queued requests one at a time until the job is cancelled."""
        waiting = self.coord.infer_queue
        while True:
            self.coord.pump(0.2)
            self.coord.check_cancelled(self.spec.serve_id)
            now = time.monotonic()
            for late in waiting.drop(partial(PendingRequest.expired, now=now)):
                self._refuse(
                    late,
                    0,
                    f"waited {now - late.arrived:.0f} s for its turn (its wait_s); requests of "
                    f"{len(waiting)} others are served in turn: the serving job "
                    f"{self.spec.serve_id} is busy, not gone; try again later",
                )
            req = waiting.take()
            if req is None:
                continue
            why = refusal(config, req.msg)
            if why is None:
                self._run_one(plan, req)
            else:
                self._refuse(req, 0, why)

    def _run_one(self, plan: InferencePlan, req: PendingRequest) -> None:
        self.requests += 1
        n = self.requests
        devices = [DeviceId(d) for d in plan.devices]
        started = time.monotonic()
        run = RunInference(
            serve_id=self.spec.serve_id,
            epoch=self.epoch,
            round=n,
            ids=req.msg.ids,
            new_tokens=req.msg.new_tokens,
        )
        for d in devices:
            self.coord.send(d, run)
        try:
            done = self.coord.gather(InferenceDone, devices[:1], self.epoch, n, REQUEST_TIMEOUT_S)
        except JobFailed as exc:
            self._refuse(req, n, str(exc))
            raise
        latency = time.monotonic() - started
        out: InferenceDone = done[devices[0]]
        reply = InferReply(
            serve_id=self.spec.serve_id,
            request=n,
            ok=True,
            tokens=out.tokens,
            logits=out.logits if req.msg.logits else [],
            latency_s=latency,
            queued_s=started - req.arrived,
        )
        self.coord.write_soon(
            f"metrics of request {n}",
            lambda: self.coord.store.append(
                "metrics",
                self.spec.serve_id,
                {
                    "request": n,
                    "latency_s": round(latency, 6),
                    "compute_s": round(out.compute_s, 6),
                    "queued_s": round(reply.queued_s, 6),
                    "tokens_in": len(req.msg.ids),
                    "tokens_out": len(out.tokens),
                },
            ),
        )
        self.coord.send(req.peer, reply)  # after its metrics: whoever has an answer sees them
        log.info(
            "request answered",
            request=n,
            latency_s=round(latency, 4),
            tokens_in=len(req.msg.ids),
            tokens_out=len(out.tokens),
        )

    def _refuse(self, req: PendingRequest, request: int, error: str) -> None:
        """Answer `req` with `error` instead of an output."""
        reply = InferReply(serve_id=self.spec.serve_id, request=request, ok=False, error=error)
        self.coord.send(req.peer, reply)

    def _refuse_waiting(self, error: str) -> None:
        waiting = self.coord.infer_queue
        while (req := waiting.take()) is not None:
            self._refuse(req, 0, f"serving job {self.spec.serve_id} ended: {error}")
