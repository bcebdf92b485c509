"""A device's shard holds exactly its part of the model, and runs as the whole model does."""

from __future__ import annotations

import pytest
import torch

from common.galaxy.config import TransformerConfig, layer_key
from services.lib.galaxy import model, sources
from services.worker.galaxy import hmp
from services.worker.galaxy.hmp import RingLayout
from tests.galaxy.test_collectives import run_on_ring

DECODER = TransformerConfig("decoder", 2, 48, 6, 80, 101, 32, 1e-5)
ENCODER = TransformerConfig("encoder", 2, 48, 6, 80, 101, 32, 1e-12, num_classes=4)


def test_a_shard_built_tensor_by_tensor_equals_the_cut_of_the_whole_model():
    whole = model.init_weights(DECODER, 9)
    heads, cols = range(2, 5), range(17, 61)
    cut = sources.shard(whole, DECODER, heads, cols)
    built = sources.init_shard(DECODER, 9, heads, cols)
    assert cut.keys() == built.keys() == whole.keys()
    for name in cut:
        assert torch.equal(cut[name], built[name]), name
    d = DECODER.head_dim
    assert torch.equal(
        built[layer_key(1, "q.weight")], whole[layer_key(1, "q.weight")][2 * d : 5 * d]
    )
    assert torch.equal(
        built[layer_key(0, "o.weight")], whole[layer_key(0, "o.weight")][:, 2 * d : 5 * d]
    )
    assert torch.equal(
        built[layer_key(0, "down.weight")], whole[layer_key(0, "down.weight")][:, 17:61]
    )
    assert torch.equal(built["embed.token"], whole["embed.token"])  # kept whole


def test_shards_hold_a_devices_share_of_the_layers_and_together_all_of_them():
    layout = RingLayout("galaxy", (1, 3, 2), (10, 50, 20), (5, 5, 6))
    ranges = [
        (range(0, 1), range(0, 10)),
        (range(1, 4), range(10, 60)),
        (range(4, 6), range(60, 80)),
    ]
    shards = [sources.init_shard(DECODER, 1, h, c) for h, c in ranges]
    whole = model.init_weights(DECODER, 1)
    for name in ("q.weight", "up.weight"):
        key = layer_key(0, name)
        assert torch.equal(torch.cat([s[key] for s in shards]), whole[key])
    assert layout.heads == tuple(len(h) for h, _ in ranges)


@pytest.mark.parametrize("config", [DECODER, ENCODER], ids=["decoder", "encoder"])
@pytest.mark.parametrize("mode", ["galaxy", "megatron"])
def test_sharded_weights_give_the_single_device_output(config, mode):
    heads, cols = ((1, 3, 2), (10, 50, 20)) if mode == "galaxy" else ((2, 2, 2), (27, 27, 26))
    layout = RingLayout(mode, heads, cols, (5, 5, 6) if mode == "galaxy" else (16, 16, 16))
    starts = [0, heads[0], heads[0] + heads[1]]
    cstarts = [0, cols[0], cols[0] + cols[1]]
    shards = [
        sources.init_shard(
            config,
            3,
            range(starts[i], starts[i] + heads[i]),
            range(cstarts[i], cstarts[i] + cols[i]),
        )
        for i in range(3)
    ]
    ids = torch.randint(0, config.vocab_size, (16,))
    with torch.no_grad():
        want = model.forward(ids, model.init_weights(config, 3), config)
        got = run_on_ring(
            3, lambda r: hmp.run(r, layout, shards[r.rank], config, ids, timeout_s=10, sharded=True)
        )
    for out in got:
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
