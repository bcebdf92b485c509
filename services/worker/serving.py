"""A worker's serving side: time the blocks, load a shard, run its part of each request.

The coordinator's serving job drives it with three commands, each answered on
the control plane: `ProfileBlocks` (time the MHA, MLP and connective blocks
here, Galaxy's profiler), `LoadShard` (build the served weights, keep this
device's shard, open the ring to the plan's other devices) and `RunInference`
(this device's part of one request through `services.worker.galaxy.hmp`; the ring's
first device answers with the output). Tiles travel on the data plane through
a dispatcher of their own, so a serving ring never disturbs training's peers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from torch import Tensor

from common.curve import CurveKeys
from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.ids import DeviceId
from common.logging import get_logger
from common.messages import Shutdown
from common.serving_messages import (
    BlocksProfiled,
    HmpTile,
    InferenceDone,
    InferenceProgress,
    LoadShard,
    ProfileBlocks,
    RunInference,
    ShardLoaded,
)
from common.store import Store
from services.lib.galaxy import pretrained, sources
from services.lib.galaxy.sampling import Sampler
from services.worker.galaxy import hmp
from services.worker.galaxy.profiling import profile_blocks
from services.worker.step_cost import measure_step_s
from services.worker.tiles import Expecting, TileInbox, ZmqRing
from services.worker.transfers import to_device
from services.worker.transport import Dispatcher

__all__ = ["PROGRESS_EVERY_S", "Progress", "Served", "Serving"]

log = get_logger(__name__)

PROGRESS_EVERY_S = 0.02
"""Shortest time between two progress reports of one request: a fast decoder's tokens
are batched so the coordinator (and a streaming client) see a few messages a step at most."""


class Progress:
    """Collects a request's generated tokens and reports them at most every `every_s`.

    The ring's first device reports what it generated so far, so the coordinator
    can stream it and, should a device be lost, re-run the request from there.
    """

    def __init__(
        self,
        msg: RunInference,
        device: DeviceId,
        report: Callable[[InferenceProgress], None],
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.msg, self.device, self.report = msg, device, report
        self.every_s, self.clock = every_s, clock
        self.pending: list[int] = []
        self.last = float("-inf")

    def token(self, token: int) -> None:
        """One more token generated; reported now if the last report is old enough."""
        self.pending.append(token)
        if self.clock() - self.last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Report the tokens not reported yet (nothing if there are none)."""
        if not self.pending:
            return
        msg = self.msg
        self.report(
            InferenceProgress(
                device=self.device,
                serve_id=msg.serve_id,
                epoch=msg.epoch,
                round=msg.round,
                tokens=self.pending,
            )
        )
        self.pending, self.last = [], self.clock()


@dataclass(frozen=True)
class Served:
    """What `LoadShard` left in memory: the plan, the model's shape and this device's weights."""

    serve_id: str
    epoch: int
    plan: InferencePlan
    config: TransformerConfig
    weights: dict[str, Tensor]
    devices: list[DeviceId]


class Serving:
    """The serving commands of one worker; runs on the worker's main thread."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        device: DeviceId,
        keys: CurveKeys | None,
        max_bytes: int,
        timeout_s: float,
        stopped: Callable[[], str | None],
        store: Store,
        compute: torch.device | None = None,
    ) -> None:
        """`compute` is where the served blocks run (the CPU by default), as training's stage."""
        self.compute = compute or torch.device("cpu")
        self.device = device
        self.store = store
        """Redis, for the checkpoints a trained model is served from."""
        self.inbox = TileInbox(max_bytes)
        self.dispatcher = Dispatcher(ctx, device, keys, session="serve")
        self.timeout_s = timeout_s
        self.stopped = stopped
        self.served: Served | None = None
        self._announced: tuple[str, int] | None = None
        """The (job, epoch) of the newest LoadShard or ProfileBlocks, set as it arrives."""
        self._shutdown: str | None = None
        """Why the coordinator asked the worker to shut down, set as the request arrives."""

    def announce(self, msg: object) -> None:
        """Called on the control thread as each command arrives, before it is queued.

        A LoadShard of another epoch (the coordinator re-planned after a device
        loss) makes the request under way stale: its ring waits end at once
        rather than after `timeout_s`, so the new shard loads without delay. So
        does the profiling of another job (the last one ended with its request cut
        off), and a Shutdown (its ring may wait on a device the job lost).
        """
        if isinstance(msg, LoadShard | ProfileBlocks):
            self._announced = (msg.serve_id, msg.epoch)
        elif isinstance(msg, Shutdown):
            self._shutdown = f"shutdown requested: {msg.reason}"

    def _stale(self, msg: RunInference) -> Callable[[], str | None]:
        """The ring's `stopped`: the worker stops, or a newer shard was announced."""

        def stopped() -> str | None:
            new = self._announced
            if new is not None and new != (msg.serve_id, msg.epoch):
                now = f"{new[0]}/{new[1]}"
                return f"request {msg.round} of {msg.serve_id}/{msg.epoch} is stale: {now} comes"
            return self._shutdown or self.stopped()

        return stopped

    def profile(self, msg: ProfileBlocks) -> BlocksProfiled:
        """Time the blocks at the sizes asked, on random weights of the served shape."""
        config = msg.model.config()
        profile = profile_blocks(
            config,
            msg.seq_len,
            msg.heads,
            msg.cols,
            msg.rows,
            msg.repeats,
            device=self.device,
            compute=self.compute,
        )
        # the ring's own work per step (a two-device split's tile), for the cost model
        step_s = measure_step_s(self.device, max(1, msg.seq_len // 2), config.hidden)
        profile = profile.model_copy(update={"step_s": step_s})
        return BlocksProfiled(
            device=self.device, serve_id=msg.serve_id, epoch=msg.epoch, profile=profile
        )

    def load(self, msg: LoadShard) -> ShardLoaded:
        """Build the weights, keep this device's shard, and point the ring at the plan's peers."""
        started = time.perf_counter()
        plan = msg.plan
        if self.device not in plan.devices:
            raise ConfigError(f"plan of {msg.serve_id} runs on {plan.devices}, not {self.device}")
        config = msg.model.config()
        plan.check(config)
        rank = plan.devices.index(self.device)
        # the previous job's shard goes before the next is built: a device's budget holds one
        self.served = None
        self.inbox.expect(None)
        if msg.spec.source == "checkpoint" and msg.spec.job is not None:
            trained, weights, _ = sources.from_checkpoint(self.store, msg.spec.job, msg.spec.round)
            if trained != config:
                raise ConfigError(f"checkpoint of {msg.spec.job} is {trained}, planned {config}")
            weights = sources.shard(weights, config, plan.head_range(rank), plan.col_range(rank))
        elif msg.spec.source == "init":  # tensor by tensor: the whole model is never here
            weights = sources.init_shard(
                config, msg.spec.seed, plan.head_range(rank), plan.col_range(rank)
            )
        elif msg.spec.source == "pretrained" and msg.spec.path is not None:
            # slice by slice from the folder, after checking it holds the planned model
            weights = pretrained.load_shard(
                msg.spec.path, config, plan.head_range(rank), plan.col_range(rank)
            )
        else:
            full = sources.transformers_weights(config, msg.spec.seed)
            weights = sources.shard(full, config, plan.head_range(rank), plan.col_range(rank))
        weights = {name: to_device(t, self.compute) for name, t in weights.items()}
        devices = [DeviceId(d) for d in plan.devices]
        missing = [d for d in devices if d not in msg.peers]
        if missing:
            raise ConfigError(f"no data-plane address for {missing} in the plan of {msg.serve_id}")
        self.dispatcher.set_peers({d: msg.peers[d] for d in devices})
        prev = devices[(rank - 1) % len(devices)]
        self.inbox.expect(Expecting(msg.serve_id, msg.epoch, prev))
        self.served = Served(msg.serve_id, msg.epoch, plan, config, weights, devices)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        log.info(
            "shard loaded",
            job=msg.serve_id,
            mode=plan.mode,
            rank=rank,
            heads=list(plan.head_range(rank)),
            weight_bytes=nbytes,
        )
        return ShardLoaded(
            device=self.device,
            serve_id=msg.serve_id,
            epoch=msg.epoch,
            weight_bytes=nbytes,
            load_s=time.perf_counter() - started,
        )

    def run(
        self, msg: RunInference, report: Callable[[InferenceProgress], None] | None = None
    ) -> InferenceDone | None:
        """Run this device's part of one request; the ring's first device returns the answer.

        The first device also hands `report` the tokens as they are generated
        (`Progress`), all of them before it returns.
        """
        served = self.served
        if served is None or (served.serve_id, served.epoch) != (msg.serve_id, msg.epoch):
            have = f"{served.serve_id}/{served.epoch}" if served else "nothing"
            raise ConfigError(f"request for {msg.serve_id}/{msg.epoch}, loaded {have}")
        started = time.perf_counter()
        self.inbox.start(msg.round)
        ring = ZmqRing(
            served.devices,
            self.device,
            HmpTile(serve_id=msg.serve_id, epoch=msg.epoch, round=msg.round, tag="-"),
            self.dispatcher,
            self.inbox,
            self._stale(msg),
            self.compute,
        )
        ids = torch.tensor(msg.ids, dtype=torch.int64, device=self.compute)
        config, plan = served.config, served.plan
        if msg.new_tokens and config.kind != "decoder":
            raise ConfigError("only a decoder generates tokens; this model is an encoder")
        ring_or_none = None if plan.mode == "local" else ring
        sharded = plan.mode in ("galaxy", "megatron")
        prompt: list[Tensor] = []
        tokens: list[int] = []
        progress = Progress(msg, self.device, report) if report and ring.rank == 0 else None
        with torch.no_grad():
            if config.kind == "decoder":
                tokens = hmp.generate(
                    ring_or_none,
                    plan,
                    served.weights,
                    config,
                    ids,
                    msg.new_tokens,
                    tag="req",
                    timeout_s=self.timeout_s,
                    sharded=sharded,
                    on_prompt=prompt.append,
                    sampler=Sampler(msg.temperature, msg.top_p, msg.seed),
                    stop=msg.stop,
                    first_step=msg.first_step,
                    on_token=progress.token if progress is not None else None,
                )
                if progress is not None:
                    progress.flush()
            else:
                prompt.append(
                    hmp.run(
                        ring_or_none,
                        plan,
                        served.weights,
                        config,
                        ids,
                        tag="req",
                        timeout_s=self.timeout_s,
                        sharded=sharded,
                    )
                )
        if ring.rank != 0:
            return None
        # what a client wants of the output: next-token logits (decoder), class logits, or
        # the first position's hidden state (encoder without a classifier)
        logits = prompt[0]
        row = logits if logits.dim() == 1 else logits[-1 if config.kind == "decoder" else 0]
        return InferenceDone(
            device=self.device,
            serve_id=msg.serve_id,
            epoch=msg.epoch,
            round=msg.round,
            tokens=tokens,
            logits=row.tolist(),
            compute_s=time.perf_counter() - started,
        )

    def close(self) -> None:
        """Stop the ring's dispatcher after what it queued."""
        self.dispatcher.close()
