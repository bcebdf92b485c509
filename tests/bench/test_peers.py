"""The bench's peers train for real: two processes on loopback, checked against one process.

small_cnn has no batch-norm, so both DDP and the 1F1B pipeline must compute
the same steps as single-process training of the global batch: they differ
only in the order float32 sums are taken (DDP's all-reduce, the pipeline's
per-micro-batch means). Over three SGD steps with lr 0.01 that moves losses
and weights by ~1e-7 relative; the tolerances below (1e-5) are two orders
above that and far below what one wrong sample or a missing gradient scale
would change (the per-round losses differ by > 1e-3).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from common.data import dataset_for, split_indices
from common.ports import free_port
from common.zoo import ModelSpec, build_model
from tests.bench.bench_edge import Row, peer_cell, peer_columns, peer_table
from tests.bench.peers import equal_shares, even_split, pipe_microbatches

pytestmark = pytest.mark.integration

ROUNDS, BATCH, MICRO, LR, SEED = 3, 16, 4, 0.01, 1
SPEC = ModelSpec(name="small_cnn")


def _run_pair(mode: str, tmp: Path) -> list[dict[str, object]]:
    """Both ranks of `mode` as real processes; their JSON results, rank order."""
    master = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-m", "tests.bench.peers", "--mode", mode, "--rank", str(rank)]
        cmd += ["--world", "2", "--master", master, "--model", SPEC.name]
        cmd += ["--rounds", str(ROUNDS), "--global-batch", str(BATCH)]
        cmd += ["--micro-batch", str(MICRO), "--lr", str(LR), "--seed", str(SEED)]
        cmd += ["--timeout", "60", "--result", str(tmp / f"{mode}{rank}.json")]
        cmd += ["--save", str(tmp / f"{mode}{rank}.pt")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return [json.loads((tmp / f"{mode}{r}.json").read_text()) for r in range(2)]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of the same rounds: each round's loss, then the weights."""
    model = build_model(SPEC, SEED).full()
    data = dataset_for(build_model(SPEC, SEED), SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for r in range(ROUNDS):
        x, y = data.batch(split_indices("train", r * BATCH, BATCH))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


def _load(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, weights_only=True))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ddp_replicas_agree_with_each_other_and_with_one_process(tmp_path: Path) -> None:
    results = _run_pair("ddp", tmp_path)
    ref_loss, ref_weights = _reference()
    for res in results:
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert len(res["round_s"]) == ROUNDS  # type: ignore[arg-type]
        assert res["samples_per_s"] > 0  # type: ignore[operator]
    w0, w1 = _load(tmp_path / "ddp0.pt"), _load(tmp_path / "ddp1.pt")
    for k in w0:  # same start, same all-reduced gradient: bit-identical replicas
        assert torch.equal(w0[k], w1[k]), k
    _close(w0, ref_weights)


def test_pipeline_trains_like_one_process(tmp_path: Path) -> None:
    first, last = _run_pair("pipe", tmp_path)
    ref_loss, ref_weights = _reference()
    assert first["loss"] == []  # only the last stage sees the loss
    assert last["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert last["microbatches"] == BATCH // MICRO
    # small_cnn's 7 layers split evenly over 2 stages: layers 0-3 and 4-6.
    stage0, stage1 = _load(tmp_path / "pipe0.pt"), _load(tmp_path / "pipe1.pt")
    joined = {k: v for k, v in stage0.items()}
    for k, v in stage1.items():
        i, _, rest = k.partition(".")
        joined[f"{int(i) + 4}.{rest}"] = v
    _close(joined, ref_weights)


def test_even_split_and_shares() -> None:
    assert even_split(7, 2) == [(0, 4), (4, 7)]
    assert even_split(20, 6) == [(0, 4), (4, 8), (8, 11), (11, 14), (14, 17), (17, 20)]
    assert equal_shares(32, 6) == [6, 6, 5, 5, 5, 5]
    with pytest.raises(ValueError, match="3 layers into 4"):
        even_split(3, 4)


def test_pipeline_microbatches_reach_the_stage_count() -> None:
    assert pipe_microbatches(32, 8, 4) == 4  # the job's own 4 micro-batches
    assert pipe_microbatches(32, 8, 6) == 8  # 6 stages: 8 micro-batches of 4
    assert pipe_microbatches(16, 4, 6) == 8
    with pytest.raises(ValueError, match="cannot feed 6"):
        pipe_microbatches(5, 1, 6)


def test_bench_table_marks_oom_and_divides_by_the_peer() -> None:
    rows = [
        Row("env-c", "mobilenet_v2", "asteroid", "finished", measured=30.0),
        Row("env-c", "mobilenet_v2", "torch-ddp", "finished", measured=8.0),
        Row("env-c", "mobilenet_v2", "torch-pipe", note="OOM: killed on nano-0"),
    ]
    assert peer_columns(rows, "env-c", "mobilenet_v2") == {
        "ddp_samples_per_s": "8.0",
        "asteroid_over_ddp": "3.75",
        "pipe_samples_per_s": "OOM",
        "asteroid_over_pipe": "",
    }
    failed = Row("env-d", "bert_small", "torch-pipe", note="failed: rank 1 exited with 1")
    assert peer_cell(failed) == "failed: rank 1 exited with 1"
    table = "\n".join(peer_table(rows))
    assert "| env-c | mobilenet_v2 | 30.0 | 8.0 | OOM | 3.75x |  | >= 3x DDP: met |" in table
