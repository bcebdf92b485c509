"""Distributed forwards over in-process rings against the single-device reference model."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from common.errors import ConfigError, RoundTimeoutError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from services.lib.galaxy import model
from services.worker.galaxy import hmp
from services.worker.galaxy.collectives import placement
from services.worker.galaxy.hmp import RingLayout
from services.worker.galaxy.ring import LocalRing, local_rings
from tests.galaxy.test_collectives import run_on_ring

T = 7  # tokens of the test request
HIDDEN, HEADS, FFN = 32, 4, 64

CONFIGS = {
    "encoder": TransformerConfig("encoder", 2, HIDDEN, HEADS, FFN, 50, 16, 1e-12),
    "classifier": TransformerConfig("encoder", 2, HIDDEN, HEADS, FFN, 50, 16, 1e-12, 3),
    "decoder": TransformerConfig("decoder", 2, HIDDEN, HEADS, FFN, 50, 16, 1e-5),
}

LAYOUTS = {
    "galaxy2-even": RingLayout("galaxy", (2, 2), (32, 32), (4, 3)),
    "galaxy2-uneven-overlap": RingLayout("galaxy", (3, 1), (40, 24), (6, 1), overlap=True),
    "galaxy3-even": RingLayout("galaxy", (2, 1, 1), (22, 21, 21), (3, 2, 2)),
    "galaxy3-uneven-overlap": RingLayout("galaxy", (1, 2, 1), (10, 30, 24), (3, 0, 4), True),
    "galaxy3-uneven-plain": RingLayout("galaxy", (1, 2, 1), (10, 30, 24), (3, 0, 4)),
    "megatron2": RingLayout("megatron", (2, 2), (32, 32), (T, T)),
    "megatron3-uneven": RingLayout("megatron", (1, 1, 2), (16, 40, 8), (T, T, T)),
    "megatron3-overlap": RingLayout("megatron", (2, 1, 1), (22, 21, 21), (T, T, T), True),
    "sp2": RingLayout("sp", (HEADS, HEADS), (FFN, FFN), (4, 3)),
    "sp3-uneven": RingLayout("sp", (HEADS,) * 3, (FFN,) * 3, (1, 5, 1)),
    "sp3-empty-device": RingLayout("sp", (HEADS,) * 3, (FFN,) * 3, (0, 3, 4)),
}


def _weights(config: TransformerConfig) -> dict[str, Tensor]:
    """Reference weights made sharper and with non-trivial biases and norms.

    Zero biases and unit norms would hide a bias added twice or on the wrong rows.
    """
    gen = torch.Generator().manual_seed(1)
    w = model.init_weights(config, seed=0)
    return {
        k: v * 10 if v.dim() == 2 else v + 0.1 * torch.randn(v.shape, generator=gen)
        for k, v in w.items()
    }


def _forward_on_ring(
    layout: RingLayout, w: dict[str, Tensor], cfg: TransformerConfig, ids: Tensor
) -> list[Tensor]:
    return run_on_ring(len(layout.rows), lambda r: hmp.run(r, layout, w, cfg, ids, timeout_s=10))


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_distributed_forward_equals_single_device(kind: str, layout_name: str) -> None:
    cfg, layout = CONFIGS[kind], LAYOUTS[layout_name]
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    with torch.no_grad():
        reference = model.forward(ids, w, cfg)
        got = _forward_on_ring(layout, w, cfg, ids)
    for out in got:
        assert out.shape == reference.shape
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
        assert torch.equal(out, got[0])  # every device returns the same logits


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_devices_without_heads_or_columns_still_take_part(kind: str) -> None:
    cfg = CONFIGS[kind]
    layout = RingLayout("galaxy", (3, 0, 1), (0, 40, 24), (2, 2, 3), overlap=True)
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    with torch.no_grad():
        reference = model.forward(ids, w, cfg)
        got = _forward_on_ring(layout, w, cfg, ids)
    for out in got:
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)


def test_tiled_and_plain_galaxy_agree() -> None:
    cfg = CONFIGS["decoder"]
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    plain = RingLayout("galaxy", (1, 2, 1), (10, 30, 24), (2, 1, 4))
    tiled = RingLayout("galaxy", (1, 2, 1), (10, 30, 24), (2, 1, 4), overlap=True)
    with torch.no_grad():
        a = _forward_on_ring(plain, w, cfg, ids)[0]
        b = _forward_on_ring(tiled, w, cfg, ids)[0]
    # each tiled collective agrees with its plain form to 1e-6 (test_collectives); two
    # layers of them, and one-row tiles rounded by a different BLAS kernel, stay within 1e-5
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not torch.equal(a, torch.zeros_like(a))


def test_local_mode_is_the_reference() -> None:
    cfg = CONFIGS["classifier"]
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    layout = RingLayout("local", (HEADS,), (FFN,), (T,))
    with torch.no_grad():
        assert torch.equal(hmp.run(None, layout, w, cfg, ids), model.forward(ids, w, cfg))


def test_an_inference_plan_is_a_layout() -> None:
    cfg = CONFIGS["decoder"]
    plan = InferencePlan(
        mode="galaxy",
        devices=["a", "b", "c"],
        heads=[2, 1, 1],
        cols=[30, 20, 14],
        rows=[2, 4, 1],
        seq_len=T,
        overlap=True,
    )
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    with torch.no_grad():
        reference = model.forward(ids, w, cfg)
        got = run_on_ring(3, lambda r: hmp.run(r, plan, w, cfg, ids, timeout_s=10))
    for out in got:
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)


DECODE_LAYOUTS = {
    "galaxy-overlap": RingLayout("galaxy", (2, 1, 1), (40, 8, 16), (1, 4, 2), overlap=True),
    "galaxy-plain": RingLayout("galaxy", (1, 1, 2), (21, 22, 21), (3, 2, 2)),
    "megatron": RingLayout("megatron", (1, 2, 1), (16, 16, 32), (T, T, T)),
    "sp": RingLayout("sp", (HEADS,) * 3, (FFN,) * 3, (2, 0, 5)),
}


@pytest.mark.parametrize("layout_name", list(DECODE_LAYOUTS))
def test_cached_decode_on_three_devices_matches_single_device_generate(layout_name: str) -> None:
    cfg, layout = CONFIGS["decoder"], DECODE_LAYOUTS[layout_name]
    w = _weights(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (T,))
    expected = model.generate(prompt, w, cfg, 6)
    got = run_on_ring(3, lambda r: hmp.generate(r, layout, w, cfg, prompt, 6, timeout_s=10))
    assert got == [expected] * 3


def test_cached_steps_give_the_reference_logits() -> None:
    cfg, layout = CONFIGS["decoder"], DECODE_LAYOUTS["galaxy-overlap"]
    w = _weights(cfg)
    ids = torch.randint(0, cfg.vocab_size, (T + 2,))
    with torch.no_grad():
        reference = model.forward(ids, w, cfg)

        def body(ring: LocalRing) -> list[Tensor]:
            cache = hmp.new_cache(layout, ring.rank, cfg)
            return [
                hmp.run(ring, layout, w, cfg, part, cache, timeout_s=10)
                for part in (ids[:T], ids[T : T + 1], ids[T + 1 :])
            ]

        got = run_on_ring(3, body)
    for steps in got:
        torch.testing.assert_close(torch.cat(steps), reference, rtol=0, atol=1e-5)


def test_decode_rows_follow_the_plan() -> None:
    assert placement([2, 2, 2], 1) == [1, 0, 0]
    assert placement([1, 3, 2], 1) == [0, 1, 0]
    assert placement([3, 0, 4], 7) == [3, 0, 4]
    assert placement([3, 0, 4], 14) == [6, 0, 8]
    assert placement([3, 0, 4], 2) == [1, 0, 1]
    with pytest.raises(ConfigError, match="not all 0"):
        placement([0, 0], 1)


def test_a_missing_peer_fails_within_the_timeout_naming_it() -> None:
    cfg = CONFIGS["encoder"]
    rings = local_rings(3)
    layout = LAYOUTS["galaxy3-even"]
    ids = torch.randint(0, cfg.vocab_size, (T,))
    with pytest.raises(RoundTimeoutError, match=r"device 2 expected .* from device 1"):
        hmp.run(rings[2], layout, _weights(cfg), cfg, ids, timeout_s=0.3)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (RingLayout("galaxy", (2, 1), (32, 32), (4, 3)), "heads per device must be >= 0 and sum"),
        (RingLayout("galaxy", (2, 2), (32, 31), (4, 3)), "cols per device must be >= 0 and sum"),
        (RingLayout("galaxy", (2, 2, 0), (32, 32, 0), (4, 3, 0)), "ring has 2 devices"),
        (RingLayout("pipeline", (2, 2), (32, 32), (4, 3)), "mode must be one of"),
    ],
)
def test_layouts_that_do_not_fit_are_refused(layout: RingLayout, message: str) -> None:
    cfg = CONFIGS["encoder"]
    ids = torch.zeros(T, dtype=torch.long)
    with pytest.raises(ConfigError, match=message):
        hmp.run(local_rings(2)[0], layout, _weights(cfg), cfg, ids)


def test_only_a_one_device_local_layout_runs_without_a_ring() -> None:
    cfg = CONFIGS["encoder"]
    ids = torch.zeros(T, dtype=torch.long)
    with pytest.raises(ConfigError, match="1-device local layout"):
        hmp.run(None, RingLayout("local", (4, 4), (64, 64), (7, 7)), _weights(cfg), cfg, ids)
    with pytest.raises(ConfigError, match="1-device local layout"):
        hmp.run(None, LAYOUTS["galaxy2-even"], _weights(cfg), cfg, ids)


def test_a_cache_of_other_heads_is_refused() -> None:
    cfg = CONFIGS["decoder"]
    layout = RingLayout("galaxy", (2, 2), (32, 32), (4, 3))
    ring = local_rings(2)[1]
    with pytest.raises(ConfigError, match=r"needs a cache of heads range\(2, 4\)"):
        hmp.run(
            ring,
            layout,
            _weights(cfg),
            cfg,
            torch.zeros(T, dtype=torch.long),
            model.KVCache(cfg, range(0, 2)),
        )
