"""Where served weights come from: `transformers` models and our training zoo.

`transformers` models: GPT-2, BERT and the Llama family (Llama, Mistral, Qwen2,
which share one tensor layout and differ in biases and the attention window).

Both are renamed into the flat dict of `common.galaxy.config` and checked
tensor by tensor against the shape the config implies, so a model that does
not fit fails here with the offending name instead of deep inside a GEMM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.extras import require
from common.galaxy.config import TransformerConfig, layer_key
from services.lib.galaxy.llama import LLAMA_FAMILY, from_llama, llama_family_model
from services.lib.galaxy.shapes import check_weights, expected_shapes, take

if TYPE_CHECKING:
    from common.zoo import ZooModel

__all__ = [
    "BERT_LAYER_NAMES",
    "check_weights",
    "expected_shapes",
    "from_bert_small",
    "from_transformers",
    "llama_family_model",
]

BERT_LAYER_NAMES = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "o": "attention.output.dense",
    "ln1": "attention.output.LayerNorm",
    "up": "intermediate.dense",
    "down": "output.dense",
    "ln2": "output.LayerNorm",
}
"""Our name of each tensor of a BERT layer, and the modules' name (transformers' and a model
folder's, under `encoder.layer.{i}.`)."""
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


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
        for arch in LLAMA_FAMILY
        for suffix in ("ForCausalLM", "Model")
    )
    if isinstance(model, transformers.GPT2LMHeadModel | transformers.GPT2Model):
        config, w = _from_gpt2(model, transformers.GPT2LMHeadModel)
    elif isinstance(model, transformers.BertForSequenceClassification | transformers.BertModel):
        config, w = _from_bert(model, transformers.BertForSequenceClassification)
    elif isinstance(model, llamas):
        config, w = from_llama(model)
    else:
        raise ConfigError(
            "from_transformers takes GPT2LMHeadModel, GPT2Model, BertModel, "
            "BertForSequenceClassification or a Llama, Mistral or Qwen2 model "
            f"(ForCausalLM or Model), got {type(model).__name__}"
        )
    check_weights(config, w)
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
    w = {"embed.token": take(sd, f"{p}wte.weight"), "embed.position": take(sd, f"{p}wpe.weight")}
    if p and not torch.equal(take(sd, "lm_head.weight"), w["embed.token"]):
        raise ConfigError("GPT-2 LM head must be tied to wte (as GPT-2's is); it is not")
    w["final_norm.weight"], w["final_norm.bias"] = (
        take(sd, f"{p}ln_f.weight"),
        take(sd, f"{p}ln_f.bias"),
    )
    for i in range(config.layers):
        b = f"{p}h.{i}."
        # Conv1D stores (in, out): transpose to nn.Linear's (out, in)
        qkv_w = take(sd, f"{b}attn.c_attn.weight").T
        qkv_b = take(sd, f"{b}attn.c_attn.bias")
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
            w[layer_key(i, f"{ours}.weight")] = take(sd, f"{b}{theirs}.weight").T.contiguous()
            w[layer_key(i, f"{ours}.bias")] = take(sd, f"{b}{theirs}.bias")
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            w[layer_key(i, f"{ours}.weight")] = take(sd, f"{b}{theirs}.weight")
            w[layer_key(i, f"{ours}.bias")] = take(sd, f"{b}{theirs}.bias")
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
    segment0 = take(sd, f"{e}token_type_embeddings.weight")[0]
    w = {
        "embed.token": take(sd, f"{e}word_embeddings.weight"),
        "embed.position": take(sd, f"{e}position_embeddings.weight") + segment0,
        "embed.norm.weight": take(sd, f"{e}LayerNorm.weight"),
        "embed.norm.bias": take(sd, f"{e}LayerNorm.bias"),
    }
    for i in range(config.layers):
        for ours, theirs in BERT_LAYER_NAMES.items():
            for part in ("weight", "bias"):
                key = f"{p}encoder.layer.{i}.{theirs}.{part}"
                w[layer_key(i, f"{ours}.{part}")] = take(sd, key)
    if classifies:
        w["pool.weight"], w["pool.bias"] = (
            take(sd, "bert.pooler.dense.weight"),
            take(sd, "bert.pooler.dense.bias"),
        )
        w["classify.weight"], w["classify.bias"] = (
            take(sd, "classifier.weight"),
            take(sd, "classifier.bias"),
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
        "embed.token": take(head_sd, "token.weight"),
        "embed.position": take(head_sd, "position.weight"),
        "embed.norm.weight": take(head_sd, "norm.weight"),
        "embed.norm.bias": take(head_sd, "norm.bias"),
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
                w[layer_key(i, f"{ours}.{part}")] = take(sd, f"{theirs}.{part}")
    tail_sd = tail.state_dict()
    for ours, theirs in (("pool", "pooler"), ("classify", "classifier")):
        for part in ("weight", "bias"):
            w[f"{ours}.{part}"] = take(tail_sd, f"{theirs}.{part}")
    check_weights(config, w)
    return config, w
