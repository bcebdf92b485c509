"""Where served weights come from: `transformers` models and our training zoo.

`transformers` models: GPT-2, BERT and the Llama family (Llama, Mistral, Qwen2,
which share one tensor layout and differ in biases and the attention window).

Both are renamed into the flat dict of `common.galaxy.config` and checked
tensor by tensor against the shape the config implies, so a model that does
not fit fails here with the offending name instead of deep inside a GEMM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.extras import require
from common.galaxy.config import TransformerConfig, layer_key

if TYPE_CHECKING:
    from common.zoo import ZooModel

__all__ = [
    "check_weights",
    "expected_shapes",
    "from_bert_small",
    "from_transformers",
    "llama_family_model",
]

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_LLAMA_FAMILY = ("Llama", "Mistral", "Qwen2")
"""transformers architectures whose tensors are named alike (`model.layers.{i}.self_attn...`)."""


def expected_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `config` needs, by name, with its shape (its options decide which)."""
    h, f, kv = config.hidden, config.ffn, config.kv_hidden
    shapes: dict[str, tuple[int, ...]] = {"embed.token": (config.vocab_size, h)}
    if config.positions == "absolute":
        shapes["embed.position"] = (config.max_positions, h)
    norms = ["embed.norm"] if config.kind == "encoder" else ["final_norm"]
    mlp = ("gate", "up") if config.activation == "swiglu" else ("up",)
    for i in range(config.layers):
        for name, rows, bias in (
            ("q", h, config.qkv_bias),
            ("k", kv, config.qkv_bias),
            ("v", kv, config.qkv_bias),
            ("o", h, config.o_bias),
        ):
            shapes[layer_key(i, f"{name}.weight")] = (rows, h)
            if bias:
                shapes[layer_key(i, f"{name}.bias")] = (rows,)
        for name in mlp:
            shapes[layer_key(i, f"{name}.weight")] = (f, h)
            if config.mlp_bias:
                shapes[layer_key(i, f"{name}.bias")] = (f,)
        shapes[layer_key(i, "down.weight")] = (h, f)
        if config.mlp_bias:
            shapes[layer_key(i, "down.bias")] = (h,)
        norms += [layer_key(i, "ln1"), layer_key(i, "ln2")]
    for prefix in norms:
        shapes[f"{prefix}.weight"] = (h,)
        if config.norm == "layer":
            shapes[f"{prefix}.bias"] = (h,)
    if not config.tied_head:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    if config.num_classes:
        shapes["pool.weight"], shapes["pool.bias"] = (h, h), (h,)
        shapes["classify.weight"] = (config.num_classes, h)
        shapes["classify.bias"] = (config.num_classes,)
    return shapes


def check_weights(config: TransformerConfig, w: Mapping[str, Tensor]) -> None:
    """Refuse weights that lack a tensor `config` needs or hold one of another shape.

    Raises:
        ConfigError: Naming the first missing or misshapen tensor, expected vs actual.

    """
    for name, shape in expected_shapes(config).items():
        if name not in w:
            raise ConfigError(f"weights lack tensor {name!r} of shape {shape}")
        if tuple(w[name].shape) != shape:
            raise ConfigError(
                f"tensor {name!r} must have shape {shape} for hidden {config.hidden}, "
                f"heads {config.heads}, ffn {config.ffn}; got {tuple(w[name].shape)}"
            )


def _take(sd: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in sd:
        raise ConfigError(f"model lacks tensor {key!r}")
    return sd[key].detach().clone().float()


def from_transformers(model: nn.Module) -> tuple[TransformerConfig, dict[str, Tensor]]:
    """Config and weights of a `transformers` GPT-2, BERT or Llama-family model.

    GPT2LMHeadModel / GPT2Model become a decoder; BertModel and
    BertForSequenceClassification an encoder, with token type 0 folded into the
    position table so serving needs no segment ids; Llama, Mistral and Qwen2
    (the causal LM or the bare model) a decoder with RMSNorm, rotary positions,
    SwiGLU and grouped-query attention.

    Raises:
        ConfigError: For another model class, an activation or position scheme we
            do not compute, a GPT-2 with an untied LM head, or a missing or
            misshapen tensor.

    """
    transformers = require("transformers", "converting a transformers model")

    llamas = tuple(
        getattr(transformers, f"{arch}{suffix}")
        for arch in _LLAMA_FAMILY
        for suffix in ("ForCausalLM", "Model")
    )
    if isinstance(model, transformers.GPT2LMHeadModel | transformers.GPT2Model):
        config, w = _from_gpt2(model, transformers.GPT2LMHeadModel)
    elif isinstance(model, transformers.BertForSequenceClassification | transformers.BertModel):
        config, w = _from_bert(model, transformers.BertForSequenceClassification)
    elif isinstance(model, llamas):
        config, w = _from_llama(model)
    else:
        raise ConfigError(
            "from_transformers takes GPT2LMHeadModel, GPT2Model, BertModel, "
            "BertForSequenceClassification or a Llama, Mistral or Qwen2 model "
            f"(ForCausalLM or Model), got {type(model).__name__}"
        )
    check_weights(config, w)
    return config, w


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


def _from_llama(model: nn.Module) -> tuple[TransformerConfig, dict[str, Tensor]]:
    config = _llama_config(model)
    sd = model.state_dict()
    p = "model." if "model.embed_tokens.weight" in sd else ""
    w = {
        "embed.token": _take(sd, f"{p}embed_tokens.weight"),
        "final_norm.weight": _take(sd, f"{p}norm.weight"),
    }
    if p:  # a causal LM: its head, unless tied to the embedding
        head = _take(sd, "lm_head.weight")
        if not config.tied_head:
            w["lm_head.weight"] = head
        elif not torch.equal(head, w["embed.token"]):
            raise ConfigError("tie_word_embeddings is set but lm_head differs from embed_tokens")
    elif not config.tied_head:  # the bare model has no head: logits through the embedding
        config = dataclasses.replace(config, tied_head=True)
    pairs = {
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
    shapes = expected_shapes(config)
    for i in range(config.layers):
        for ours, theirs in pairs.items():
            for part in ("weight", "bias"):
                if layer_key(i, f"{ours}.{part}") in shapes:
                    key = f"{p}layers.{i}.{theirs}.{part}"
                    w[layer_key(i, f"{ours}.{part}")] = _take(sd, key)
    return config, w


def _from_gpt2(
    model: nn.Module, lm_class: type[Any]
) -> tuple[TransformerConfig, dict[str, Tensor]]:
    hf: Any = model.config
    if hf.activation_function not in _TANH_GELUS:
        raise ConfigError(
            f"GPT-2 activation must be one of {_TANH_GELUS}, got {hf.activation_function!r}"
        )
    sd = model.state_dict()
    p = "transformer." if isinstance(model, lm_class) else ""
    hidden = int(hf.n_embd)
    config = TransformerConfig(
        kind="decoder",
        layers=int(hf.n_layer),
        hidden=hidden,
        heads=int(hf.n_head),
        ffn=int(hf.n_inner) if hf.n_inner is not None else 4 * hidden,
        vocab_size=int(hf.vocab_size),
        max_positions=int(hf.n_positions),
        ln_eps=float(hf.layer_norm_epsilon),
    )
    w = {"embed.token": _take(sd, f"{p}wte.weight"), "embed.position": _take(sd, f"{p}wpe.weight")}
    if p and not torch.equal(_take(sd, "lm_head.weight"), w["embed.token"]):
        raise ConfigError("GPT-2 LM head must be tied to wte (as GPT-2's is); it is not")
    w["final_norm.weight"], w["final_norm.bias"] = (
        _take(sd, f"{p}ln_f.weight"),
        _take(sd, f"{p}ln_f.bias"),
    )
    for i in range(config.layers):
        b = f"{p}h.{i}."
        # Conv1D stores (in, out): transpose to nn.Linear's (out, in)
        qkv_w = _take(sd, f"{b}attn.c_attn.weight").T
        qkv_b = _take(sd, f"{b}attn.c_attn.bias")
        if qkv_w.shape[0] != 3 * hidden:
            raise ConfigError(
                f"{b}attn.c_attn must have {3 * hidden} outputs for hidden {hidden}, "
                f"got {qkv_w.shape[0]}"
            )
        for j, name in enumerate(("q", "k", "v")):
            w[layer_key(i, f"{name}.weight")] = qkv_w[j * hidden : (j + 1) * hidden].contiguous()
            w[layer_key(i, f"{name}.bias")] = qkv_b[j * hidden : (j + 1) * hidden].contiguous()
        pairs = {
            "o": "attn.c_proj",
            "up": "mlp.c_fc",
            "down": "mlp.c_proj",
        }
        for ours, theirs in pairs.items():
            w[layer_key(i, f"{ours}.weight")] = _take(sd, f"{b}{theirs}.weight").T.contiguous()
            w[layer_key(i, f"{ours}.bias")] = _take(sd, f"{b}{theirs}.bias")
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            w[layer_key(i, f"{ours}.weight")] = _take(sd, f"{b}{theirs}.weight")
            w[layer_key(i, f"{ours}.bias")] = _take(sd, f"{b}{theirs}.bias")
    return config, w


def _from_bert(
    model: nn.Module, cls_class: type[Any]
) -> tuple[TransformerConfig, dict[str, Tensor]]:
    hf: Any = model.config
    if hf.hidden_act != "gelu":
        raise ConfigError(f"BERT activation must be 'gelu' (erf), got {hf.hidden_act!r}")
    position_type = getattr(hf, "position_embedding_type", None) or "absolute"
    if position_type != "absolute":
        raise ConfigError(f"BERT position embeddings must be 'absolute', got {position_type!r}")
    sd = model.state_dict()
    classifies = isinstance(model, cls_class)
    p = "bert." if classifies else ""
    config = TransformerConfig(
        kind="encoder",
        layers=int(hf.num_hidden_layers),
        hidden=int(hf.hidden_size),
        heads=int(hf.num_attention_heads),
        ffn=int(hf.intermediate_size),
        vocab_size=int(hf.vocab_size),
        max_positions=int(hf.max_position_embeddings),
        ln_eps=float(hf.layer_norm_eps),
        num_classes=int(hf.num_labels) if classifies else 0,
    )
    e = f"{p}embeddings."
    segment0 = _take(sd, f"{e}token_type_embeddings.weight")[0]
    w = {
        "embed.token": _take(sd, f"{e}word_embeddings.weight"),
        "embed.position": _take(sd, f"{e}position_embeddings.weight") + segment0,
        "embed.norm.weight": _take(sd, f"{e}LayerNorm.weight"),
        "embed.norm.bias": _take(sd, f"{e}LayerNorm.bias"),
    }
    pairs = {
        "q": "attention.self.query",
        "k": "attention.self.key",
        "v": "attention.self.value",
        "o": "attention.output.dense",
        "ln1": "attention.output.LayerNorm",
        "up": "intermediate.dense",
        "down": "output.dense",
        "ln2": "output.LayerNorm",
    }
    for i in range(config.layers):
        for ours, theirs in pairs.items():
            for part in ("weight", "bias"):
                key = f"{p}encoder.layer.{i}.{theirs}.{part}"
                w[layer_key(i, f"{ours}.{part}")] = _take(sd, key)
    if classifies:
        w["pool.weight"], w["pool.bias"] = (
            _take(sd, "bert.pooler.dense.weight"),
            _take(sd, "bert.pooler.dense.bias"),
        )
        w["classify.weight"], w["classify.bias"] = (
            _take(sd, "classifier.weight"),
            _take(sd, "classifier.bias"),
        )
    return config, w


def from_bert_small(zoo_model: ZooModel) -> tuple[TransformerConfig, dict[str, Tensor]]:
    """Config and weights of the zoo's `bert_small`, so a trained job's model can be served.

    Its layers are embeddings, encoder layers, then pooler plus classifier.

    Raises:
        ConfigError: If the layers are not that shape, or a tensor is missing or
            does not fit the config read from the modules.

    """
    # the zoo is needed only for this source, so it is imported only here
    from common.zoo.bert import Embeddings, EncoderLayer, PoolerClassifier

    layers = zoo_model.layers
    emb, first, tail = layers[0], layers[1 % len(layers)], layers[-1]
    if (
        len(layers) < 3
        or not isinstance(emb, Embeddings)
        or not isinstance(first, EncoderLayer)
        or not isinstance(tail, PoolerClassifier)
        or not all(isinstance(m, EncoderLayer) for m in layers[1:-1])
    ):
        kinds = [type(m).__name__ for m in layers]
        raise ConfigError(
            f"bert_small must be Embeddings, EncoderLayer..., PoolerClassifier; got {kinds}"
        )
    up = first.ffn.up
    if not isinstance(up, nn.Linear):
        raise ConfigError(f"bert_small ffn.up must be nn.Linear, got {type(up).__name__}")
    config = TransformerConfig(
        kind="encoder",
        layers=len(layers) - 2,
        hidden=emb.token.embedding_dim,
        heads=first.attention.heads,
        ffn=up.out_features,
        vocab_size=emb.token.num_embeddings,
        max_positions=emb.position.num_embeddings,
        ln_eps=float(emb.norm.eps),
        num_classes=zoo_model.num_classes,
    )
    head_sd = emb.state_dict()
    w: dict[str, Tensor] = {
        "embed.token": _take(head_sd, "token.weight"),
        "embed.position": _take(head_sd, "position.weight"),
        "embed.norm.weight": _take(head_sd, "norm.weight"),
        "embed.norm.bias": _take(head_sd, "norm.bias"),
    }
    pairs = {
        "q": "attention.query",
        "k": "attention.key",
        "v": "attention.value",
        "o": "attention.out",
        "ln1": "attention_norm",
        "up": "ffn.up",
        "down": "ffn.down",
        "ln2": "ffn_norm",
    }
    for i, layer in enumerate(layers[1:-1]):
        sd = layer.state_dict()
        for ours, theirs in pairs.items():
            for part in ("weight", "bias"):
                w[layer_key(i, f"{ours}.{part}")] = _take(sd, f"{theirs}.{part}")
    tail_sd = tail.state_dict()
    for ours, theirs in (("pool", "pooler"), ("classify", "classifier")):
        for part in ("weight", "bias"):
            w[f"{ours}.{part}"] = _take(tail_sd, f"{theirs}.{part}")
    check_weights(config, w)
    return config, w
