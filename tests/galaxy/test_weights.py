from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from common.zoo import ModelSpec, build_model
from services.lib.galaxy.model import forward, init_weights
from services.lib.galaxy.weights import check_weights, from_bert_small, from_transformers

transformers = pytest.importorskip("transformers")


def _perturb(model: nn.Module, seed: int) -> None:
    """Randomise every parameter, biases and LayerNorms too, so a mis-mapped one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _gpt2(lm_head: bool) -> Any:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=100,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    cls = transformers.GPT2LMHeadModel if lm_head else transformers.GPT2Model
    model = cls(cfg)
    _perturb(model, seed=1)  # lm_head is tied: perturbing wte moves both
    return model.eval()


def _bert_config(**kw: Any) -> Any:
    return transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=64,
        attn_implementation="eager",
        **kw,
    )


def test_gpt2_lm_logits_equal_transformers() -> None:
    model = _gpt2(lm_head=True)
    config, w = from_transformers(model)
    assert (config.kind, config.layers, config.hidden, config.heads, config.ffn) == (
        "decoder",
        2,
        64,
        4,
        256,
    )
    ids = torch.randint(0, 100, (20,))
    with torch.no_grad():
        want = model(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(forward(ids, w, config), want, atol=1e-4, rtol=0)


def test_gpt2_model_hidden_states_feed_our_head() -> None:
    model = _gpt2(lm_head=False)
    config, w = from_transformers(model)
    ids = torch.randint(0, 100, (9,))
    with torch.no_grad():
        hidden = model(ids.unsqueeze(0)).last_hidden_state[0]  # after ln_f
    torch.testing.assert_close(
        forward(ids, w, config), hidden @ w["embed.token"].T, atol=1e-4, rtol=0
    )


def test_bert_hidden_states_equal_transformers() -> None:
    model = transformers.BertModel(_bert_config())
    _perturb(model, seed=2)
    model.eval()
    config, w = from_transformers(model)
    assert config.kind == "encoder" and config.num_classes == 0
    ids = torch.randint(0, 100, (17,))
    with torch.no_grad():
        want = model(ids.unsqueeze(0)).last_hidden_state[0]
    torch.testing.assert_close(forward(ids, w, config), want, atol=1e-4, rtol=0)


def test_bert_classifier_logits_equal_transformers() -> None:
    model = transformers.BertForSequenceClassification(_bert_config(num_labels=5))
    _perturb(model, seed=3)
    model.eval()
    config, w = from_transformers(model)
    assert config.num_classes == 5
    ids = torch.randint(0, 100, (12,))
    with torch.no_grad():
        want = model(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(forward(ids, w, config), want, atol=1e-4, rtol=0)


def test_bert_small_zoo_forward_equals_ours() -> None:
    spec = ModelSpec(
        name="bert_small",
        num_classes=4,
        options={"vocab_size": 50, "seq_len": 16, "hidden": 32, "layers": 2, "heads": 4},
    )
    zoo = build_model(spec, seed=7)
    for layer in zoo.layers:
        _perturb(layer, seed=8)
    config, w = from_bert_small(zoo)
    assert (config.layers, config.hidden, config.heads, config.ffn) == (2, 32, 4, 128)
    ids = torch.randint(0, 50, (16,))
    net = zoo.full().eval()
    with torch.no_grad():
        want = net(ids.unsqueeze(0))[0]
    torch.testing.assert_close(forward(ids, w, config), want, atol=1e-5, rtol=0)
    # the served copy does not alias the trainable parameters
    w["embed.token"].zero_()
    assert zoo.layers[0].state_dict()["token.weight"].abs().sum() > 0


def test_missing_or_misshapen_tensors_are_named() -> None:
    model = _gpt2(lm_head=True)
    config, w = from_transformers(model)
    check_weights(config, w)
    del w["layers.1.down.bias"]
    with pytest.raises(ConfigError, match=r"layers\.1\.down\.bias"):
        check_weights(config, w)
    w = init_weights(config, seed=0)
    w["layers.0.q.weight"] = torch.zeros(64, 48)
    with pytest.raises(ConfigError, match=r"layers\.0\.q\.weight.*\(64, 64\).*\(64, 48\)"):
        check_weights(config, w)


def test_inconsistent_or_foreign_models_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _gpt2(lm_head=True)
    state = model.state_dict()
    del state["transformer.h.1.mlp.c_fc.bias"]
    monkeypatch.setattr(model, "state_dict", lambda *args, **kwargs: state)
    with pytest.raises(ConfigError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias"):
        from_transformers(model)
    with pytest.raises(ConfigError, match="got Linear"):
        from_transformers(nn.Linear(2, 2))
    zoo = build_model(ModelSpec(name="mlp", num_classes=3), seed=0)
    with pytest.raises(ConfigError, match="bert_small must be"):
        from_bert_small(zoo)
