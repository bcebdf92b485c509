"""Galaxy's blocks on a GPU: the same outputs as on the CPU, decoding and profiling there.

A serving worker loads its shard onto its accelerator (`services.worker.serving`)
and runs `services.worker.galaxy.hmp` on it; these run the same code with the weights
and tokens on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.lib.galaxy import model
from services.worker.galaxy import hmp
from services.worker.galaxy.hmp import RingLayout
from services.worker.galaxy.profiling import profile_blocks
from tests.galaxy.test_hmp import CONFIGS, FFN, HEADS, T, _weights
from tests.gpu import CUDA_MARKS, exact_cuda

pytestmark = CUDA_MARKS

BLOCK_TOLERANCE = 1e-4
"""Max-abs logit difference, GPU against CPU, relative to the largest logit: float32
round-off of two-layer blocks whose kernels sum in other orders (TF32 is off)."""


@pytest.fixture
def gpu() -> Iterator[torch.device]:
    with exact_cuda() as device:
        yield device


def _on(w: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in w.items()}


@pytest.mark.parametrize("kind", ["classifier", "decoder"])
def test_a_local_forward_on_the_gpu_gives_the_cpus_logits(gpu: torch.device, kind: str) -> None:
    cfg = CONFIGS[kind]
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    layout = RingLayout("local", (HEADS,), (FFN,), (T,))
    with torch.no_grad():
        on_gpu = hmp.run(None, layout, _on(w, gpu), cfg, ids.to(gpu))
        on_cpu = model.forward(ids, w, cfg)
    assert on_gpu.device == gpu
    scale = float(on_cpu.abs().max())
    assert float((on_gpu.cpu() - on_cpu).abs().max()) <= BLOCK_TOLERANCE * scale


def test_greedy_decoding_runs_on_the_gpu(gpu: torch.device) -> None:
    cfg = CONFIGS["decoder"]
    w = _on(_weights(cfg), gpu)
    ids = torch.randint(0, cfg.vocab_size, (4,)).to(gpu)
    layout = RingLayout("local", (HEADS,), (FFN,), (4,))
    tokens = hmp.generate(None, layout, w, cfg, ids, 5, tag="req")
    assert tokens == model.generate(ids, w, cfg, 5, use_cache=False)


def test_blocks_are_profiled_on_the_gpu(gpu: torch.device) -> None:
    prof = profile_blocks(CONFIGS["encoder"], 8, [HEADS], [FFN], [8], 3, compute=gpu)
    assert all(s > 0 for _, s in (*prof.mha, *prof.mlp, *prof.con))
