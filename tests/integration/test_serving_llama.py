"""A Llama-family model served by real worker processes answers as transformers does.

Three workers over ZeroMQ with a real Redis (the fixture of `test_serving`); the
shape has grouped-query attention (6 query heads in 3 KV groups), rotary
positions, RMSNorm, SwiGLU and an untied head, and its weights come from the
`transformers` source, so each answer is checked against transformers' own
forward and greedy generate of the same seeded model.
"""

from __future__ import annotations

import pytest
import torch

from common.serving_messages import ServeSpec, TransformerShape
from services.cli.serve import infer_request
from services.lib.galaxy import sources
from tests.integration.test_serving import Serving, serving  # noqa: F401 (the fixture)

pytestmark = pytest.mark.integration

LLAMA = TransformerShape(
    kind="decoder",
    layers=2,
    hidden=48,
    heads=6,
    ffn=96,
    vocab_size=300,
    max_positions=64,
    ln_eps=1e-6,
    kv_heads=3,
    norm="rms",
    positions="rope",
    rope_theta=5e5,
    mlp="swiglu",
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    tied_head=False,
)


# galaxy in the default suite; the other modes' splits are covered by the ring tests
# (tests/galaxy/test_llama.py), so their runs through real workers are slow-only
@pytest.mark.parametrize(
    "mode",
    [
        "galaxy",
        pytest.param("megatron", marks=pytest.mark.slow),
        pytest.param("sp", marks=pytest.mark.slow),
    ],
)
def test_a_served_llama_answers_as_transformers_does(serving: Serving, mode: str) -> None:  # noqa: F811
    spec = ServeSpec(
        serve_id=f"llama-{mode}", source="transformers", model=LLAMA, seed=5, mode=mode, seq_len=12
    )
    serving.start(spec)
    hf = sources.transformers_model(LLAMA.config(), 5)
    ids = [5, 17, 3, 250, 9, 9, 1, 42, 7, 7, 100, 2]
    reply = infer_request(serving.cluster.addr, spec.serve_id, ids, new_tokens=5)
    assert reply.ok, reply.error
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
        tokens = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    got = torch.tensor(reply.logits)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert reply.tokens == tokens[0, len(ids) :].tolist()
    serving.stop(spec.serve_id)
