"""One stage replica of a plan on one device: compute, routing and the round.

`StageRunner.run_round` is the scheduler loop of Asteroid's Fig. 11: it asks
the pure `next_task` which task to run, runs it, hands results to the
dispatcher (which sends while the next task computes), and at round end
all-reduces gradients inside the group and steps the optimizer once, at the
learning rate the job's schedule gives that round. A device the plan splits
(Duan & Wu's beta, `Allocation.forward_share`) runs the pair `next_pair` gives
instead, a forward and a backward at once on `SplitLanes`. In `mode: async`
every micro-batch is a mini-batch: the stage updates its weights right after
its backward, forwards run on stashed versions (`WeightStash`, vertical sync
by `common.async_versions`), and the round is a window that ends without an
all-reduce or step of its own. Held-out evaluation runs through the same
routes in `services.worker.evaluate`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from common.async_versions import aggregates_after
from common.checkpoint import (
    load_stage,
    restore_optimizer,
    save_stage,
    stage_digest,
    stage_state,
    stage_tensors,
)
from common.errors import CheckpointError, ConfigError, RoundAbortedError
from common.ids import DeviceId
from common.job import OptimizerSpec, learning_rate
from common.job_data import open_data
from common.messages import Activation, Assign, Gradient, LayerState, ReduceChunk, StageTimings
from common.plan import routes
from common.saved_bytes import SavedBytes, weight_storages
from common.schedule import Action, PoolView, next_pair, next_task
from common.settings import REDIS_OUTAGE_S
from common.store import Store
from common.zoo import ZooModel, build_model
from services.lib.lanes import SplitLanes
from services.worker.allreduce import ring_allreduce
from services.worker.async_stream import AsyncStream
from services.worker.evaluate import EvalResult, evaluate
from services.worker.faults import FailAt
from services.worker.holdings import HeldLayer, Holdings
from services.worker.numerics import require_finite
from services.worker.pool import Expected, TaskPool
from services.worker.stash import WeightStash
from services.worker.transfers import to_device, to_host
from services.worker.transport import Dispatcher

__all__ = [
    "RoundResult",
    "RoundState",
    "StageRunner",
    "blob_tensor",
    "layers_state",
    "make_optimizer",
    "stage_layers",
    "steps_on_host",
]

StageState = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]
"""Stage-module weights (keys `j.rest`) and optimizer state by parameter name."""


def blob_tensor(blob: bytes) -> torch.Tensor:
    """A blob as the one uint8 tensor frame a LayerState carries (a copy: bytes are read-only)."""
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def steps_on_host(compute: torch.device, replicas: int) -> bool:
    """Whether a stage's optimizer steps a host copy of its weights rather than the GPU's.

    Replicas of a stage must hold the same bits (the coordinator compares their
    digests at each checkpoint). The all-reduce gives each the same gradient, but
    a GPU's and a CPU's optimizer step may round differently (fused multiply-adds,
    other kernels), and a data-parallel group may mix a Jetson with a Pi. So a
    replicated stage on a GPU steps on the host, as its CPU peers do, and copies
    the new weights to the GPU (a copy is exact); a stage alone, or on a CPU,
    steps where it computes.
    """
    return compute.type != "cpu" and replicas > 1


def make_optimizer(params: list[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The job's optimizer over this stage's parameters."""
    if spec.kind == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    if spec.kind == "adam":
        return torch.optim.Adam(
            params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
    if spec.kind == "adamw":
        return torch.optim.AdamW(
            params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay
        )
    raise ConfigError(f"optimizer.kind {spec.kind!r} is not sgd, adam or adamw")


def stage_layers(
    module: nn.Sequential, optimizer: torch.optim.Optimizer, start: int
) -> dict[int, HeldLayer]:
    """The stage's state now, layer by layer (layers start, start+1, ...), as copies.

    The same tensors, under the same names, as a checkpoint's layer blob
    (`common.checkpoint.stage_blobs`), but copied, not serialised: a snapshot
    taken every round then costs a memory copy, and only layers that are sent
    are ever serialised (`HeldLayer.blob`).
    """
    tensors = stage_tensors(module, optimizer, start)
    return {layer: HeldLayer(tensors=held) for layer, held in tensors.items()}


def layers_state(
    layers: Mapping[int, HeldLayer], start: int, end: int, source: str = "the state received"
) -> StageState:
    """Layers [start, end) as stage-module weights and optimizer state by parameter.

    Raises:
        CheckpointError: A layer is missing or its bytes are not valid safetensors.

    """
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for layer in range(start, end):
        held = layers.get(layer)
        if held is None:
            raise CheckpointError(f"{source} has no layer {layer}")
        try:
            tensors[layer] = held.tensors()
        except CheckpointError as exc:
            raise CheckpointError(f"{source}: layer {layer} {exc}") from exc
    return stage_state(tensors, start)


def _storages(params: Mapping[str, torch.Tensor]) -> frozenset[int]:
    """Storages of a stashed version: held once per version, not per micro-batch."""
    return frozenset(t.untyped_storage().data_ptr() for t in params.values())


def _job_rounds(assign: Assign) -> int:
    """Rounds of the whole job, which the learning-rate schedule is relative to.

    The coordinator's count wins (it may know a dataset's size this stage
    cannot see); without one the job spec must say.
    """
    if assign.total_rounds:
        return assign.total_rounds
    try:
        return assign.job.total_rounds()
    except ConfigError as exc:
        raise ConfigError(f"Assign.total_rounds is 0 and the job spec cannot tell: {exc}") from exc


@dataclass
class RoundResult:
    """What a worker reports for one round.

    `peak_bytes` is the most the stage held at once: tensors in its task pool
    plus the activations kept for backwards still to run (autograd's saved
    tensors, the stage's input and output); `peak_saved_bytes` is the latter's own peak.
    """

    samples: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    max_alive: int = 0
    peak_bytes: int = 0
    peak_saved_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def stage_timings(self) -> StageTimings:
        """The timings as the wire model."""
        return StageTimings(**self.timings)


@dataclass
class RoundState:
    """A round in progress on one stage: what the scheduler loop keeps between tasks."""

    round_no: int
    res: RoundResult
    policy: str
    t0: float
    ctx: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Input and output of each micro-batch whose backward has not run."""
    kept: dict[int, int] = field(default_factory=dict)
    """Bytes each of those micro-batches keeps: saved tensors, input and output."""
    next_f: int = 0
    done_b: int = 0
    timings: dict[str, float] = field(
        default_factory=lambda: {"forward_s": 0.0, "backward_s": 0.0, "wait_s": 0.0}
    )
    used: dict[int, int] = field(default_factory=dict)
    """async: the version each micro-batch in flight was forwarded on."""
    ahead_buffers: dict[str, torch.Tensor] | None = None
    """async: the buffers the forwards of the next window run on (`AsyncStream`)."""


class StageRunner:
    """Runs stage `assign.stage` of `assign.plan` as device `device`."""

    def __init__(
        self,
        assign: Assign,
        device: DeviceId,
        store: Store,
        pool: TaskPool,
        dispatcher: Dispatcher,
        task_timeout_s: float,
        allowed_modules: tuple[str, ...] = (),
        store_patience_s: float = REDIS_OUTAGE_S,
        fail_at: FailAt | None = None,
        layers: Mapping[int, HeldLayer] | None = None,
        holdings: Holdings | None = None,
        bulk: Dispatcher | None = None,
        zoo: ZooModel | None = None,
        compute: torch.device | None = None,
    ) -> None:
        """Build the stage and load its state at version `assign.from_round`.

        `compute` is the device the stage's weights, optimizer state and
        computation live on (the CPU by default); what crosses the wire and
        what checkpoints hold stays in host memory (`services.worker.transfers`).

        `zoo` is the job's model if the worker built it already: its layers are
        reused (their whole state is loaded anew), so a re-assignment does not
        pay for building the network again.

        `layers` give that state from this worker's own copies and its peers;
        without them it comes from the Redis checkpoint. With `holdings`, the
        state at each round's start is kept for recovery, and `bulk` (a
        low-priority dispatcher) carries replicas. `load_timings` says where
        the construction's time went.
        """
        self.assign, self.device, self.store = assign, device, store
        self.holdings, self.bulk = holdings, bulk
        self.store_patience_s = store_patience_s
        """How long a checkpoint waits out a Redis outage (the worker's redis_outage_s)."""
        self.fail_at = fail_at
        """Where to kill this worker on purpose (tests and benchmarks); None: never."""
        self.pool, self.out, self.timeout = pool, dispatcher, task_timeout_s
        plan, p = assign.plan, assign.stage
        self.plan, self.p, self.epoch = plan, p, assign.epoch
        self.first, self.last = p == 0, p == len(plan.stages) - 1
        self.k = plan.warmup(p)
        self.m = plan.microbatches
        # the first stage makes its own inputs: all its forwards are always ready
        self._own_inputs = frozenset(range(self.m))
        spec = plan.stages[p]
        self.start, self.end = spec.start, spec.end
        self.group = [a.device for a in spec.devices]
        self.rank = self.group.index(device)
        self.span = plan.ranges(p)[device]
        beta = next(a.forward_share for a in spec.devices if a.device == device)
        self.lanes = SplitLanes(beta) if beta is not None else None
        """The forward lane beside this thread's backward, when the plan splits the device."""
        self._progress_lock = threading.Lock()
        self.fwd_routes = (
            []
            if self.last
            else [r for r in routes(plan.ranges(p), plan.ranges(p + 1)) if r.src == device]
        )
        self.bwd_routes = (
            []
            if self.first
            else [r for r in routes(plan.ranges(p - 1), plan.ranges(p)) if r.dst == device]
        )
        t0 = time.perf_counter()
        # user modules come from this worker's own settings (model_modules), never from the Assign
        zoo = zoo or build_model(assign.job.model, assign.job.seed, allowed_modules)
        self.num_classes = zoo.num_classes
        """Width of the logits: labels from the previous stage must lie in [0, num_classes)."""
        self.compute = compute or torch.device("cpu")
        self.module = zoo.stage(self.start, self.end).to(self.compute)
        t1 = time.perf_counter()
        weights, optim_state = self._state(layers)
        t2 = time.perf_counter()
        self.module.load_state_dict(weights)
        self.module.train()
        self._weights = weight_storages(self.module)  # not counted as held per micro-batch
        self.master = self.module
        """The weights the optimizer steps and checkpoints read: the module itself, or for
        a replicated stage on a GPU a host copy (`steps_on_host`)."""
        if steps_on_host(self.compute, len(self.group)):  # its own tensors, not the zoo's layers
            self.master = copy.deepcopy(self.module).to("cpu")
        self.optimizer = make_optimizer(list(self.master.parameters()), assign.job.optimizer)
        restore_optimizer(self.master, self.optimizer, optim_state)
        self.load_timings = {
            "build_s": t1 - t0,
            "read_s": t2 - t1,
            "load_s": time.perf_counter() - t2,
        }
        """Seconds spent building the model, reading the state and loading it."""
        self.total_rounds = _job_rounds(assign)
        # only the first stage reads samples; later stages get them as activations
        self.data = open_data(assign.job, zoo, allowed_modules) if self.first else None
        self.round = assign.from_round
        """The version of the weights held: rounds committed before them."""
        self.in_round = False
        """True from a round's start to its optimizer step: the live state may then be
        neither version (batch-norm statistics move with each forward)."""
        self.progress = 0
        """Tasks finished: forwards (held-out ones too), backwards, all-reduce steps and
        optimizer steps. Heartbeats carry it, so the coordinator tells a hung stage from a
        slow one."""
        self.waiting = False
        """True while blocked on a peer or on Redis, a wait with its own bound (the task
        timeout, redis_outage_s): standing still then is not a hang of this device."""
        self.stash = WeightStash(self.module) if assign.job.mode == "async" else None
        """async: the weight versions micro-batches in flight and to come run on."""
        self._lr_round = -1
        """async: the round whose learning rate the optimizer holds (set once per window)."""
        self.k0 = min(plan.warmup(0), self.m)
        """The first stage's warm-up, which fixes every micro-batch's version (vertical sync)."""
        every = assign.job.aggregate_every
        self.stream = (
            AsyncStream(assign.from_round, self.m, self.k, self.k0, every, self.total_rounds)
            if self.stash is not None
            else None
        )
        """async: the stream of micro-batches across windows, from this Assign's drain point."""
        self.module.register_forward_hook(self._forwarded)
        pool.reset(
            assign.epoch,
            p,
            self.span,
            self._expected(),
            assign.from_round,
            assign.peer_timeout_s,
        )

    def _state(self, layers: Mapping[int, HeldLayer] | None) -> StageState:
        """The stage's state at `assign.from_round`: from `layers`, else from Redis."""
        version = self.assign.from_round
        if layers is not None:
            return layers_state(layers, self.start, self.end, f"the state of version {version}")
        store, job = self.store, self.assign.job.job_id
        return store.ride_out(
            lambda: load_stage(store, job, version, self.start, self.end),
            f"loading the checkpoint of round {version}",
            self.store_patience_s,
            self._idle,
        )

    def _expected(self) -> Expected:
        """Who sends this device what under the plan: the pool refuses parts from anyone else.

        Activations come from the previous stage's device of each incoming
        route, gradients back from the next stage's device each forward went
        to, reduce chunks from the device before this one in the group's ring.
        """
        size = len(self.group)
        return Expected(
            activations={(r.lo, r.hi): str(r.src) for r in self.bwd_routes},
            gradients={(r.lo, r.hi): str(r.dst) for r in self.fwd_routes},
            ring_prev=str(self.group[(self.rank - 1) % size]) if size > 1 else None,
            ring_size=size,
            microbatches=self.m,
            num_classes=self.num_classes,
        )

    @property
    def is_leader(self) -> bool:
        """The first device of the group writes the stage's checkpoints."""
        return self.rank == 0

    def param_bytes(self) -> int:
        """Bytes of this stage's parameters."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    # --- one round ----------------------------------------------------------

    def run_round(
        self, round_no: int, keep: Iterable[int] = (), replicate: bool = False
    ) -> RoundResult:
        """Forward and backward every micro-batch, all-reduce, one optimizer step."""
        state = self.begin_round(round_no, keep, replicate)
        while state.done_b < self.m:
            w0 = time.perf_counter()
            what = functools.partial(self._waiting_for, state.next_f, state.ctx)
            awaited = functools.partial(self._awaited, state)
            if self.lanes is None:
                decide = functools.partial(
                    self._decide, round_no, state.next_f, state.ctx, state.policy
                )
                with self.blocked():
                    action = self.pool.wait(decide, self.timeout, what, awaited)
                state.timings["wait_s"] += time.perf_counter() - w0
                self.run_task(state, action)
                continue
            pair = functools.partial(self._decide_pair, round_no, state.next_f, state.ctx)
            with self.blocked():
                backward, forward = self.pool.wait(pair, self.timeout, what, awaited)
            state.timings["wait_s"] += time.perf_counter() - w0
            self.lanes.run(
                None if forward is None else functools.partial(self.run_task, state, forward),
                None if backward is None else functools.partial(self.run_task, state, backward),
            )
        while self.stream is not None and (ready := self.ready_task(state)) is not None:
            self.run_task(state, ready)  # the next window's forwards ready now: beside the commit
        return self.end_round(state)

    def begin_round(
        self, round_no: int, keep: Iterable[int] = (), replicate: bool = False
    ) -> RoundState:
        """Start round `round_no`: drop older parts, clear gradients and the memory peak.

        With holdings, the state now (version `round_no`) is kept first, older
        versions not in `keep` are dropped, and with `replicate` a single-device
        stage sends that state to its backup node.
        """
        if self.holdings is not None:
            layers = self.layers()
            self.holdings.snapshot(round_no, layers)
            self.holdings.keep_only({round_no, *keep})
            if replicate:
                self._replicate(round_no, layers)
        self.in_round = True
        self.pool.begin_round(round_no)
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)  # the same, unless the step is on the host
        res = RoundResult(samples=(self.span[1] - self.span[0]) * self.m)
        state = RoundState(round_no, res, self.assign.job.policy, time.perf_counter())
        if self.stash is not None and self.stream is not None:
            self._continue_stream(state, self.stash, self.stream)
        return state

    def _continue_stream(self, state: RoundState, stash: WeightStash, stream: AsyncStream) -> None:
        """async: start the stream afresh (a drain point) or take over what ran ahead."""
        fresh, ahead = stream.begin(state.round_no)
        if fresh:  # the stream starts on the weights every update so far made
            stash.keep(set())
            stash.snapshot(0)
        if ahead is None:
            return
        state.ctx, state.kept, state.used = ahead.ctx, ahead.kept, ahead.used
        state.next_f = len(ahead.ctx)
        state.res.max_alive = len(ahead.ctx)
        self.pool.hold_saved(sum(ahead.kept.values()))
        if ahead.buffers is not None:  # the statistics move on from the cut only now
            with torch.no_grad():
                for name, buffer in self.module.named_buffers():
                    buffer.copy_(ahead.buffers[name])

    def ready_task(self, state: RoundState) -> Action | None:
        """The task the scheduler would run now, or None; never waits (for lockstep drivers)."""
        with self.pool.cond:
            return self._decide(state.round_no, state.next_f, state.ctx, state.policy)

    def run_task(self, state: RoundState, action: Action) -> None:
        """Run one forward or backward; tell the pool what its forward keeps until the backward.

        A forward and a backward may run at once (`SplitLanes`): each touches
        its own fields of `state` (dictionary entries of other micro-batches)
        and counts progress under a lock.
        """
        c0 = time.perf_counter()
        mb = action.mb
        if action.kind == "F":
            window, wmb = (state.round_no, mb)
            params = None
            if self.stash is not None and self.stream is not None:
                window, wmb = self.stream.locate(state.round_no, mb)
                state.used[mb] = self.stream.version_of(state.round_no, mb)
                params = self.stash.params(state.used[mb])
                if window != state.round_no:  # run ahead: the live buffers stay at the cut
                    if state.ahead_buffers is None:
                        state.ahead_buffers = {
                            name: b.detach().clone() for name, b in self.module.named_buffers()
                        }
                    params = {**params, **state.ahead_buffers}
            if self.fail_at is not None:
                self.fail_at.check(window, "forward", wmb)
            skip = self._weights if params is None else self._weights | _storages(params)
            kept = SavedBytes(skip)
            with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
                state.ctx[mb] = self._forward(window, wmb, state.res, params)
            for t in state.ctx[mb]:  # the runner keeps input and output for the backward
                kept.pack(t)
            state.kept[mb] = kept.total
            self.pool.hold_saved(kept.total)
            state.res.max_alive = max(state.res.max_alive, len(state.ctx))
            state.next_f += 1
            state.timings["forward_s"] += time.perf_counter() - c0
        else:
            if self.fail_at is not None:
                self.fail_at.check(state.round_no, "backward", mb)
            self._backward(state.round_no, mb, *state.ctx.pop(mb))
            self.pool.release_saved(state.kept.pop(mb))
            if self.stash is not None:
                self._update(state, mb, self.stash)
            state.done_b += 1
            self._advance()
            state.timings["backward_s"] += time.perf_counter() - c0

    def end_round(self, state: RoundState) -> RoundResult:
        """All-reduce inside the group, step the optimizer, report the round."""
        round_no, t = state.round_no, state.timings
        a0 = time.perf_counter()
        if self.fail_at is not None:
            self.fail_at.check(round_no, "allreduce")
        if self.stash is None:  # async: a single device, updated after every backward
            self._allreduce(round_no)
        s0 = time.perf_counter()
        if self.stash is None:
            self._step(round_no)
        else:
            self._check_window(round_no)
        if self.fail_at is not None:
            self.fail_at.check(round_no, "step")
        t["allreduce_s"] = s0 - a0
        t["step_s"] = time.perf_counter() - s0
        t["total_s"] = time.perf_counter() - state.t0
        res = state.res
        res.timings = t
        res.peak_bytes, res.peak_saved_bytes = self.pool.peak_bytes, self.pool.peak_saved_bytes
        if self.stream is not None:  # what ran ahead waits for the next window's RunRound
            self.stream.end(round_no, state.ctx, state.kept, state.used, state.ahead_buffers)
        self.round = round_no + 1
        self.in_round = False
        return res

    def _view(self, round_no: int, next_f: int, ctx: dict[int, Any]) -> PoolView:
        """What the scheduler sees now (called under the pool's lock)."""
        # a gradient is only a task once its forward ran here (ctx holds it)
        alive = frozenset(ctx)
        forward_ready = self._own_inputs if self.first else self.pool.ready(round_no, "F")
        if self.stream is not None and (ahead := self.stream.lookahead(round_no)):
            if self.first:
                forward_ready = frozenset(range(self.m + ahead))
            else:  # the next window's parts the previous stage already sent
                nxt = self.pool.ready(round_no + 1, "F")
                forward_ready |= frozenset(self.m + i for i in nxt if i < ahead)
        return PoolView(
            next_forward=next_f,
            alive=len(ctx),
            forward_ready=forward_ready,
            backward_ready=alive if self.last else self.pool.ready(round_no, "B") & alive,
        )

    def _bounds(self, round_no: int) -> tuple[int, int]:
        """The scheduler's K_p and forward count: async's stream runs ahead into the next window."""
        if self.stream is None:
            return self.k, self.m
        return self.stream.limit, self.stream.slots(round_no)

    def _step(self, round_no: int) -> None:
        """One optimizer step at the learning rate the job's schedule gives `round_no`.

        Gradients are checked before it and weights after it (one pass each per
        step): inf or nan of this worker's own making never reaches a replica,
        a checkpoint or a committed round; the round fails instead.
        """
        lr = learning_rate(self.assign.job.optimizer, round_no, self.total_rounds)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        named = list(self.master.named_parameters())
        require_finite(
            ((name, p.grad) for name, p in named if p.grad is not None),
            f"the gradient of round {round_no} on stage {self.p}",
        )
        self.optimizer.step()
        require_finite(named, f"the weights after the step of round {round_no} at lr {lr:g}")
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.module:
            with torch.no_grad():  # copies are exact: stepped weights in, statistics out
                for live, stepped in zip(
                    self.module.parameters(), self.master.parameters(), strict=True
                ):
                    live.copy_(stepped)
                for buffer, kept in zip(self.module.buffers(), self.master.buffers(), strict=True):
                    kept.copy_(buffer)
            self.module.zero_grad(set_to_none=True)
        self._advance()

    def _update(self, state: RoundState, mb: int, stash: WeightStash) -> None:
        """async: apply micro-batch `mb`'s gradients (of its stashed version) to the weights.

        Then aggregate when due, drop the versions no micro-batch in flight or
        still to come runs on, and stash the new version. Backwards arrive in
        micro-batch order, which the version arithmetic relies on. It checks
        nothing: the window does, at its end (`async_stream`, "An update's cost").
        An async stage is alone in its group: the module is `master`.
        """
        stream = self.stream
        if stream is None or mb != state.done_b:
            raise RuntimeError(f"async backward of micro-batch {mb} out of order")
        grads = stash.take_grads(state.used.pop(mb))
        for param, grad in zip(stash.live, grads, strict=True):
            param.grad = grad
        if self._lr_round != state.round_no:  # the schedule moves once per window
            self._lr_round = state.round_no
            lr = learning_rate(self.assign.job.optimizer, state.round_no, self.total_rounds)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        for param in stash.live:
            param.grad = None
        self._advance()
        stream.version += 1
        stream.updated = [*stream.updated, stream.version][-self.k0 :]
        g = (state.round_no - stream.drain) * self.m + mb  # aggregation counts the stream
        if aggregates_after(g, stream.every, self.m):
            # the next aggregation comes `every` updates or more later: it averages the
            # version just made again only if that is fewer than K_0 updates
            stash.aggregate(stream.updated, keep_last=stream.every < self.k0)
            stream.version += 1
        stash.keep({*state.used.values(), *stream.needed(state.next_f, state.round_no)})
        stash.snapshot(stream.version)

    def _check_window(self, round_no: int) -> None:
        """async: check the live weights once per window, before RoundDone (`async_stream`: why)."""
        require_finite(
            self.master.named_parameters(),
            f"the weights of stage {self.p} after the updates of round {round_no}",
        )

    def _decide(
        self, round_no: int, next_f: int, ctx: dict[int, Any], policy: str
    ) -> Action | None:
        """Ask the pure scheduler what to run now (called under the pool's lock)."""
        k, m = self._bounds(round_no)
        return next_task(self._view(round_no, next_f, ctx), self.p, k, m, policy)

    def _decide_pair(
        self, round_no: int, next_f: int, ctx: dict[int, Any]
    ) -> tuple[Action | None, Action | None] | None:
        """The backward and forward to run side by side now, or None (under the pool's lock)."""
        view = self._view(round_no, next_f, ctx)
        pair = next_pair(view, self.p, self.k, self.m, self.assign.job.policy)
        return None if pair == (None, None) else pair

    def _awaited(self, state: RoundState) -> set[str]:
        """Neighbours whose data a blocked round waits for (called under the pool's lock).

        The previous stage's senders of the next forward's activations, while
        the schedule would run that forward, and the next stage's senders of
        the gradients of forwards that ran here.
        """
        out: set[str] = set()
        limit = self.k if state.policy == "1f1b" else self.m
        if not self.first and state.next_f < self.m and len(state.ctx) < limit:
            out |= self.pool.missing(state.round_no, "F", state.next_f)
        if not self.last and (state.policy == "1f1b" or state.next_f >= self.m):
            for mb in list(state.ctx):
                out |= self.pool.missing(state.round_no, "B", mb)
        return out

    def _waiting_for(self, next_f: int, ctx: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> str:
        if ctx and not self.last:
            return f"gradients of micro-batches {sorted(ctx)} from stage {self.p + 1}"
        return f"activations of micro-batch {next_f} from stage {self.p - 1}"

    def _forward(
        self,
        round_no: int,
        mb: int,
        res: RoundResult,
        params: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward `mb` on the live weights, or on `params` (a stashed version, async)."""
        lo, hi = self.span
        if self.data is not None:
            base = round_no * self.plan.global_batch + mb * self.plan.micro_size
            x, y = self.data.train_batch(base + lo, hi - lo)
            x = to_device(x, self.compute)
        else:
            x, y = self.pool.take(round_no, "F", mb)
            x = to_device(x, self.compute)
            if x.is_floating_point():
                x.requires_grad_(True)
        out = self.module(x) if params is None else functional_call(self.module, params, (x,))
        if self.last:
            y = to_device(y, self.compute)
            summed = nn.functional.cross_entropy(out, y, reduction="sum")
            loss = summed / self.plan.global_batch
            # the labels and inputs were checked on arrival: a non-finite loss is our own
            require_finite([("", loss)], f"the loss of micro-batch {mb} in round {round_no}")
            res.loss_sum += float(loss.detach())
            res.correct += int((out.detach().argmax(dim=1) == y).sum())
            # async: each micro-batch is a mini-batch, its gradient that of its own mean
            return x, (loss if params is None else summed / self.plan.micro_size)
        require_finite(
            [("", out)],
            f"the activations of micro-batch {mb} in round {round_no} on stage {self.p}",
        )
        sent = to_host(out.detach())  # one copy off a GPU; its slices are framed as they are
        for r in self.fwd_routes:
            msg = Activation(
                epoch=self.epoch, round=round_no, mb=mb, stage=self.p + 1, lo=r.lo, hi=r.hi
            )
            self.out.send(r.dst, msg, [sent[r.lo - lo : r.hi - lo], y[r.lo - lo : r.hi - lo]])
        return x, out

    def _backward(self, round_no: int, mb: int, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.last:
            out.backward()  # type: ignore[no-untyped-call]
        else:
            (grad,) = self.pool.take(round_no, "B", mb)
            out.backward(to_device(grad, self.compute))  # type: ignore[no-untyped-call]
        if self.first or x.grad is None:
            return
        require_finite(
            [("", x.grad)],
            f"the gradients of micro-batch {mb} in round {round_no} on stage {self.p}",
        )
        lo = self.span[0]
        grad_in = to_host(x.grad)
        for r in self.bwd_routes:
            msg = Gradient(
                epoch=self.epoch, round=round_no, mb=mb, stage=self.p - 1, lo=r.lo, hi=r.hi
            )
            self.out.send(r.src, msg, [grad_in[r.lo - lo : r.hi - lo]])

    def _allreduce(self, round_no: int) -> None:
        """Sum gradients over the group, and average float buffers.

        Buffers (batch-norm statistics) are weighted by each replica's samples so
        that replicas stay identical. The sums run in host memory, in the ring's
        order: each chunk is summed once, along the same path whatever device a
        replica computes on, and every replica receives that one result, so a
        GPU replica and a CPU replica of a stage hold the same bits.
        """
        if len(self.group) == 1:
            return
        params = list(self.module.parameters())
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        weight = (self.span[1] - self.span[0]) / self.plan.micro_size
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            + [(b * weight).reshape(-1) for b in buffers]
        )
        nxt = self.group[(self.rank + 1) % len(self.group)]

        def send(step: int, chunk: int, tensor: torch.Tensor) -> None:
            msg = ReduceChunk(
                epoch=self.epoch, round=round_no, stage=self.p, step=step, chunk=chunk
            )
            self.out.send(nxt, msg, [tensor])

        def recv(step: int, chunk: int) -> torch.Tensor:
            with self.blocked():
                chunk_sum = self.pool.take_chunk(round_no, step, chunk, self.timeout)
            self.progress += 1
            return chunk_sum

        host = to_host(flat)  # a GPU's gradients cross once; a CPU's are reduced in place
        summed = ring_allreduce(host, self.rank, len(self.group), send, recv)
        # the optimizer's weights get the gradients where they are (`self.master`)
        total = summed if self.master is not self.module else to_device(summed, self.compute)
        offset = 0
        for tensor in self.master.parameters():
            n = tensor.numel()
            tensor.grad = total[offset : offset + n].view_as(tensor)
            offset += n
        with torch.no_grad():
            for b in buffers:
                n = b.numel()
                b.copy_(summed[offset : offset + n].view_as(b))
                offset += n

    def _forwarded(self, *_: object) -> None:
        """Count a forward of the stage (a hook: held-out evaluation runs forwards too)."""
        self._advance()

    def _advance(self) -> None:
        """Count a finished task; the forward lane counts too, hence the lock."""
        with self._progress_lock:
            self.progress += 1

    def close(self) -> None:
        """Stop the forward lane, if any (the runner is being replaced)."""
        if self.lanes is not None:
            self.lanes.close()

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """Mark the stage as waiting on a peer or on Redis for the duration."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False

    def _idle(self, seconds: float) -> None:
        """Wait `seconds` between Redis attempts; give up at once if the worker is stopping."""
        time.sleep(seconds)
        if self.pool.aborted is not None:
            raise RoundAbortedError(self.pool.aborted)

    def run_eval(self, round_no: int, batches: int) -> EvalResult:
        """Evaluate the weights of round `round_no` on `batches` held-out global batches."""
        return evaluate(self, round_no, batches)

    # --- state: replicas, migration, checkpoints ------------------------------

    def layers(self) -> dict[int, HeldLayer]:
        """A copy of the live stage state, layer by layer (serialised only when sent)."""
        return stage_layers(self.master, self.optimizer, self.start)

    def _replicate(self, version: int, layers: Mapping[int, HeldLayer]) -> None:
        """Send the state of `version` to this stage's backup node, layer by layer.

        Only a single-device stage has one (a group's peers are its replicas).
        The bulk dispatcher has its own connection, so the round's activations
        never queue behind a replica.
        """
        backup = self.plan.backup_of(self.p)
        if backup is None or self.bulk is None:
            return
        for layer, held in sorted(layers.items()):
            msg = LayerState(
                epoch=self.epoch,
                version=version,
                layer=layer,
                purpose="replica",
                start=self.start,
                end=self.end,
            )
            self.bulk.send(str(backup), msg, [blob_tensor(held.blob())])

    def save(self, round_no: int) -> tuple[list[int], str]:
        """Checkpoint `round_no`: the leader writes the layers; every replica digests its state.

        Returns the layers written (none on a non-leader) and the digest of this
        replica's weights, buffers and optimizer state, for the coordinator to compare.
        """
        layers = []
        if self.is_leader:
            with self.blocked():
                layers = self.store.ride_out(
                    lambda: save_stage(
                        self.store,
                        self.assign.job.job_id,
                        round_no,
                        self.master,
                        self.optimizer,
                        self.start,
                    ),
                    f"saving the checkpoint of stage {self.p} round {round_no}",
                    self.store_patience_s,
                    self._idle,
                )
        return layers, stage_digest(self.master, self.optimizer)
