"""Stage state held as copies: snapshots, what recovery sends, what a new stage loads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

from common.checkpoint import (
    save_stage,
    stage_blobs,
    stage_digest,
    stage_from_blobs,
)
from common.errors import AsteroidError, CheckpointError
from common.ids import DeviceId
from common.job import JobSpec, OptimizerSpec
from common.messages import Assign
from common.plan import Plan
from common.zoo import ModelSpec, build_model
from services.worker.holdings import HeldLayer, Holdings
from services.worker.main import Worker
from services.worker.pool import TaskPool
from services.worker.stage import StageRunner, layers_state, make_optimizer, stage_layers
from services.worker.transport import Dispatcher
from tests.worker.local_pipeline import LocalPipeline

SGD = {"kind": "sgd", "lr": 0.05, "momentum": 0.9}
TWO_STAGES = [
    {"start": 0, "end": 4, "devices": [{"device": "a"}]},
    {"start": 4, "end": 7, "devices": [{"device": "b"}]},
]
MOVED = [  # the split point moves: layer 3 changes hands
    {"start": 0, "end": 3, "devices": [{"device": "a"}]},
    {"start": 3, "end": 7, "devices": [{"device": "b"}]},
]


def trained_stage(kind: str) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """Layers 2..5 of small_cnn after one step, so the optimizer holds state."""
    zoo = build_model(ModelSpec(name="small_cnn"), 3)
    stage = zoo.stage(2, 6)
    opt = make_optimizer(
        list(stage.parameters()), OptimizerSpec.model_validate({"kind": kind, "lr": 0.1})
    )
    with torch.no_grad():
        x = zoo.stage(0, 2)(torch.randn(4, 3, 32, 32))
    stage(x).square().sum().backward()
    opt.step()
    return stage, opt


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_snapshot_serialises_to_the_checkpoint_format_byte_for_byte(kind: str) -> None:
    stage, opt = trained_stage(kind)
    layers = stage_layers(stage, opt, 2)
    assert sorted(layers) == [2, 3, 4, 5]
    expected = stage_blobs(stage, opt, 2)
    assert {layer: held.blob() for layer, held in layers.items()} == expected


def test_a_snapshot_keeps_its_version_while_the_stage_trains_on() -> None:
    stage, opt = trained_stage("adam")
    layers = stage_layers(stage, opt, 2)
    before = stage_blobs(stage, opt, 2)
    # the live stage trains on: a weight and the optimizer state move
    with torch.no_grad():
        next(stage.parameters()).add_(1.0)
    opt.step()
    assert stage_blobs(stage, opt, 2) != before  # the live stage moved on
    assert {layer: held.blob() for layer, held in layers.items()} == before


def test_loading_copies_gives_what_loading_the_bytes_gives_and_owns_its_tensors() -> None:
    stage, opt = trained_stage("adam")
    blobs = stage_blobs(stage, opt, 2)
    layers = stage_layers(stage, opt, 2)
    weights, optim = layers_state(layers, 3, 6)
    ref_weights, ref_optim = stage_from_blobs(blobs, 3, 6)
    assert weights.keys() == ref_weights.keys() and optim.keys() == ref_optim.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
    assert all(torch.equal(optim[p][s], ref_optim[p][s]) for p in optim for s in optim[p])
    for tensor in weights.values():
        tensor.add_(1.0)  # a new stage trains what it loaded ...
    assert layers[3].blob() == blobs[3]  # ... never the snapshot


def test_bytes_from_a_peer_load_like_copies() -> None:
    stage, opt = trained_stage("sgd")
    blobs = stage_blobs(stage, opt, 2)
    from_bytes = layers_state({k: HeldLayer(blob=b) for k, b in blobs.items()}, 2, 6)
    from_copies = layers_state(stage_layers(stage, opt, 2), 2, 6)
    assert all(torch.equal(from_bytes[0][k], v) for k, v in from_copies[0].items())


def test_a_missing_or_forged_layer_is_named() -> None:
    with pytest.raises(CheckpointError, match="the state of version 4 has no layer 3"):
        layers_state({2: HeldLayer(tensors={})}, 2, 4, "the state of version 4")
    with pytest.raises(CheckpointError, match="layer 2 is not valid safetensors"):
        layers_state({2: HeldLayer(blob=b"not safetensors")}, 2, 3)
    with pytest.raises(ValueError, match="needs its tensors or its bytes"):
        HeldLayer()


def _assign(job: JobSpec, stages: list[dict[str, Any]], device: str) -> Assign:
    plan = Plan(global_batch=16, microbatches=2, stages=stages)
    return Assign(
        epoch=2, job=job, plan=plan, stage=plan.stage_of(DeviceId(device)), peers={}, from_round=1
    )


def test_a_stage_built_from_held_layers_equals_one_loaded_from_redis(store: Any) -> None:
    job = JobSpec.model_validate(
        {"job_id": "held", "model": {"name": "small_cnn"}, "seed": 5, "rounds": 3,
         "optimizer": SGD, "dataset": {"kind": "synthetic", "eval_size": 16}}
    )  # fmt: skip
    pipe = LocalPipeline(store, job, Plan(global_batch=16, microbatches=2, stages=TWO_STAGES))
    pipe.run_lockstep(0)
    held: dict[int, HeldLayer] = {}
    for runner in pipe.runners.values():  # round 1's state: version 1, momentum included
        save_stage(store, "held", 1, runner.module, runner.optimizer, runner.start)
        held.update(runner.layers())
    for device in ("a", "b"):
        msg = _assign(job, MOVED, device)
        dev = DeviceId(device)
        out = cast(Dispatcher, pipe.outs[device])  # delivers into the peers' pools
        mine = StageRunner(msg, dev, store, TaskPool(), out, 5.0, layers=held)
        ref = StageRunner(msg, dev, store, TaskPool(), out, 5.0)  # checkpoint 1 in Redis
        assert stage_digest(mine.module, mine.optimizer) == stage_digest(ref.module, ref.optimizer)
        assert mine.optimizer.state  # the momentum came along
        assert set(mine.load_timings) == {"build_s", "read_s", "load_s"}


class _Runner:
    """The parts of a stage runner `Worker._held` looks at; counts copies of the live state."""

    def __init__(self) -> None:
        self.round, self.in_round, self.start, self.end = 5, False, 2, 5
        self.copies = 0

    def layers(self) -> dict[int, HeldLayer]:
        self.copies += 1
        return {layer: HeldLayer(blob=f"live-{layer}".encode()) for layer in range(2, 5)}


def _worker(runner: _Runner, holdings: Holdings) -> Worker:
    return cast(Worker, SimpleNamespace(runner=runner, holdings=holdings, device="a"))


def test_the_live_state_is_copied_once_for_every_layer_that_needs_it() -> None:
    holdings = Holdings(1000, lambda *_: None)
    holdings.snapshot(5, {3: HeldLayer(blob=b"snap-3")})
    runner = _Runner()
    got = Worker._held(_worker(runner, holdings), 5, [2, 3, 4])
    assert {k: v.blob() for k, v in got.items()} == {2: b"live-2", 3: b"snap-3", 4: b"live-4"}
    assert runner.copies == 1


def test_the_live_state_inside_a_round_is_no_version() -> None:
    runner = _Runner()
    runner.in_round = True
    with pytest.raises(AsteroidError, match="no state of layer 2 at version 5 on a"):
        Worker._held(_worker(runner, Holdings(1000, lambda *_: None)), 5, [2])
