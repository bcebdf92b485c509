"""The Llama family in `transformers` (Llama, Mistral, Qwen2) to and from our flat weights.

One tensor layout (`model.layers.{i}.self_attn.q_proj`, `mlp.gate_proj`, ...)
with RMSNorm, rotary positions, SwiGLU and grouped-query attention; the three
differ only in biases and Mistral's attention window, which the config states.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.extras import require
from common.galaxy.config import TransformerConfig, layer_key
from services.lib.galaxy.shapes import expected_shapes, take

LLAMA_LAYER_NAMES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
}
"""Our name of each tensor of a Llama-family layer, and the modules' name (transformers' and
a model folder's, under `model.layers.{i}.`)."""

__all__ = ["LLAMA_FAMILY", "LLAMA_LAYER_NAMES", "from_llama", "llama_family_model"]

LLAMA_FAMILY = ("Llama", "Mistral", "Qwen2")
"""transformers architectures whose tensors are named alike (`model.layers.{i}.self_attn...`)."""


def _rope_theta(hf: Any) -> float:
    """The rotary base of a Llama-family config, refusing scaled RoPE we do not compute.

    transformers 5 keeps it in `rope_parameters`; earlier versions in
    `rope_theta`, with any scaling in `rope_scaling`.
    """
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"rotary scaling {kind!r} is not computed; only plain RoPE is")
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _llama_config(model: nn.Module) -> TransformerConfig:
    hf: Any = model.config
    if hf.hidden_act != "silu":
        raise ConfigError(f"Llama-family activation must be 'silu', got {hf.hidden_act!r}")
    hidden, heads = int(hf.hidden_size), int(hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ConfigError(
            f"head_dim {head_dim} times {heads} heads must be the hidden size {hidden}"
        )
    if (getattr(hf, "pretraining_tp", 1) or 1) != 1:
        raise ConfigError(f"pretraining_tp must be 1, got {hf.pretraining_tp}")
    max_positions = int(hf.max_position_embeddings)
    window = getattr(hf, "sliding_window", None)
    if window is not None and getattr(hf, "use_sliding_window", True):
        # a sequence no longer than the window never meets its mask: serve only those
        max_positions = min(max_positions, int(window))
    qwen = type(model).__name__.startswith("Qwen2")
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return TransformerConfig(
        kind="decoder",
        layers=int(hf.num_hidden_layers),
        hidden=hidden,
        heads=heads,
        ffn=int(hf.intermediate_size),
        vocab_size=int(hf.vocab_size),
        max_positions=max_positions,
        ln_eps=float(hf.rms_norm_eps),
        kv_heads=int(hf.num_key_value_heads or heads),
        norm="rms",
        positions="rope",
        rope_theta=_rope_theta(hf),
        mlp="swiglu",
        qkv_bias=qwen or attention_bias,
        o_bias=attention_bias and not qwen,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        tied_head=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def llama_family_model(config: TransformerConfig) -> nn.Module:
    """A randomly initialised `transformers` causal LM of a Llama-family shape.

    The inverse of `from_transformers` for it: Llama, or Qwen2 for biases on q,
    k, v but not o. Seed torch first for reproducible weights.

    Raises:
        ConfigError: If no Llama-family class has this shape (a GPT-2 or BERT option set).

    """
    transformers = require("transformers", "a model built by transformers")

    llama = ("decoder", "rms", "rope", "swiglu")
    qwen = config.qkv_bias and not config.o_bias
    if (config.kind, config.norm, config.positions, config.activation) != llama or (
        config.o_bias and not config.qkv_bias
    ):
        raise ConfigError(
            "a Llama-family model is a decoder with rms norm, rope positions and a swiglu MLP, "
            f"biases on q, k, v and o alike or on q, k, v only (Qwen2); got {config}"
        )
    fields: dict[str, Any] = {
        "num_hidden_layers": config.layers,
        "hidden_size": config.hidden,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_groups,
        "intermediate_size": config.ffn,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_positions,
        "rms_norm_eps": config.ln_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tied_head,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if qwen:
        if config.mlp_bias:
            raise ConfigError("Qwen2 has no MLP biases; mlp_bias must be False with o_bias off")
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))  # type: ignore[no-any-return]
    fields.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))  # type: ignore[no-any-return]


def from_llama(model: nn.Module) -> tuple[TransformerConfig, dict[str, Tensor]]:
    """Config and weights of a Llama, Mistral or Qwen2 model (ForCausalLM or the bare Model).

    A bare model has no LM head: its logits go through the tied embedding, as
    GPT2Model's do.

    Raises:
        ConfigError: For an activation, RoPE scaling or head width we do not
            compute, or a missing tensor.

    """
    config = _llama_config(model)
    sd = model.state_dict()
    p = "model." if "model.embed_tokens.weight" in sd else ""
    w = {
        "embed.token": take(sd, f"{p}embed_tokens.weight"),
        "final_norm.weight": take(sd, f"{p}norm.weight"),
    }
    if p:  # a causal LM: its head, unless tied to the embedding
        head = take(sd, "lm_head.weight")
        if not config.tied_head:
            w["lm_head.weight"] = head
        elif not torch.equal(head, w["embed.token"]):
            raise ConfigError("tie_word_embeddings is set but lm_head differs from embed_tokens")
    elif not config.tied_head:  # the bare model has no head: logits through the embedding
        config = dataclasses.replace(config, tied_head=True)
    shapes = expected_shapes(config)
    for i in range(config.layers):
        for ours, theirs in LLAMA_LAYER_NAMES.items():
            for part in ("weight", "bias"):
                if layer_key(i, f"{ours}.{part}") in shapes:
                    key = f"{p}layers.{i}.{theirs}.{part}"
                    w[layer_key(i, f"{ours}.{part}")] = take(sd, key)
    return config, w
