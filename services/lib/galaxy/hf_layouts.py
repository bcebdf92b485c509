"""How each Hugging Face architecture names its configuration and its tensors.

A model folder's `config.json` and tensor names follow the `transformers`
class that saved it; this module maps both onto `common.galaxy.config`: the
config fields become a `TransformerConfig`, and each of our flat tensors gets a
`Recipe` saying which of the folder's tensors hold it and in what orientation,
so `pretrained` can read just the rows or columns a device keeps. The mapping
is the same one `weights.from_transformers` applies to a model in memory, so
both give the very same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig, layer_key
from common.serving_messages import MAX_PROMPT_TOKENS, TransformerShape
from services.lib.galaxy.llama import LLAMA_LAYER_NAMES
from services.lib.galaxy.weights import BERT_LAYER_NAMES, expected_shapes

__all__ = ["MODEL_TYPES", "Layout", "Part", "Recipe", "layout_of"]

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Part:
    """One of the folder's tensors, or a slice of it, as it enters one of ours.

    Attributes:
        name: The folder's tensor name.
        shape: Its full shape as stored, checked before anything is read.
        transposed: Stored `(in, out)` (GPT-2's Conv1D) rather than `nn.Linear`'s `(out, in)`.
        offset: Where our rows start along its `out` axis (Q, K, V fused in GPT-2's `c_attn`).
        first_row: Only its row 0 is used, added to every row (BERT's token type 0).

    """

    name: str
    shape: tuple[int, ...]
    transposed: bool = False
    offset: int = 0
    first_row: bool = False


Recipe = tuple[Part, ...]
"""The parts whose sum is one of our tensors (one part but for BERT's position table)."""


@dataclass(frozen=True)
class Layout:
    """A folder's model: our config and, given its tensor names, each of our tensors' recipe."""

    config: TransformerConfig
    recipes: Callable[[Container[str]], dict[str, Recipe]]


def _int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config.json field {key!r} must be a number, got {value!r}")
    return float(value)


def _flag(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config.json field {key!r} must be true or false, got {value!r}")
    return value


def _bounded(fields: dict[str, Any]) -> TransformerConfig:
    """The config, within the wire's bounds: a folder claims no size a peer could not."""
    try:
        return TransformerShape(**fields).config()
    except ValidationError as exc:
        said = "; ".join(
            f"{'.'.join(map(str, e['loc']))} {e['input']!r}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"config.json describes a model we cannot serve: {said}") from None


def _architecture(raw: Mapping[str, Any], allowed: tuple[str, ...]) -> str:
    """The saved class (the first allowed, or "" when config.json names none)."""
    named = raw.get("architectures") or []
    if not isinstance(named, list) or not all(isinstance(a, str) for a in named):
        raise ConfigError(f"config.json field 'architectures' must be a list of names: {named!r}")
    if not named:
        return ""
    for arch in allowed:
        if arch in named:
            return arch
    raise ConfigError(f"config.json architectures {named} are none of {list(allowed)}")


def _prefix(names: Container[str], anchor: str, prefixes: tuple[str, ...]) -> str:
    """The prefix a head model put before the base model's names (`transformer.`, `bert.`)."""
    for p in prefixes:
        if p + anchor in names:
            return p
    raise ConfigError(f"the folder has no tensor {anchor!r} under any of {list(prefixes)}")


# --- GPT-2 -------------------------------------------------------------------


def _gpt2(raw: Mapping[str, Any]) -> Layout:
    _architecture(raw, ("GPT2LMHeadModel", "GPT2Model"))
    act = raw.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise ConfigError(f"GPT-2 activation must be one of {_TANH_GELUS}, got {act!r}")
    if _flag(raw, "scale_attn_by_inverse_layer_idx", False) or not _flag(
        raw, "scale_attn_weights", True
    ):
        raise ConfigError("GPT-2 attention must be scaled by 1/sqrt(head_dim) only")
    if not _flag(raw, "tie_word_embeddings", True):
        raise ConfigError("GPT-2 LM head must be tied to wte (as GPT-2's is); it is not")
    hidden = _int(raw, "n_embd", 768)
    inner = raw.get("n_inner")
    config = _bounded(
        {
            "kind": "decoder",
            "layers": _int(raw, "n_layer", 12),
            "hidden": hidden,
            "heads": _int(raw, "n_head", 12),
            "ffn": 4 * hidden if inner is None else _int(raw, "n_inner"),
            "vocab_size": _int(raw, "vocab_size", 50257),
            "max_positions": _int(raw, "n_positions", 1024),
            "ln_eps": _float(raw, "layer_norm_epsilon", 1e-5),
        }
    )

    def recipes(names: Container[str]) -> dict[str, Recipe]:
        p = _prefix(names, "wte.weight", ("transformer.", ""))
        h, f = config.hidden, config.ffn
        out: dict[str, Recipe] = {
            "embed.token": (Part(f"{p}wte.weight", (config.vocab_size, h)),),
            "embed.position": (Part(f"{p}wpe.weight", (config.max_positions, h)),),
            "final_norm.weight": (Part(f"{p}ln_f.weight", (h,)),),
            "final_norm.bias": (Part(f"{p}ln_f.bias", (h,)),),
        }
        for i in range(config.layers):
            b = f"{p}h.{i}."
            for j, name in enumerate(("q", "k", "v")):
                out[layer_key(i, f"{name}.weight")] = (
                    Part(f"{b}attn.c_attn.weight", (h, 3 * h), transposed=True, offset=j * h),
                )
                out[layer_key(i, f"{name}.bias")] = (
                    Part(f"{b}attn.c_attn.bias", (3 * h,), offset=j * h),
                )
            for ours, theirs, shape in (
                ("o", "attn.c_proj", (h, h)),
                ("up", "mlp.c_fc", (h, f)),
                ("down", "mlp.c_proj", (f, h)),
            ):
                out[layer_key(i, f"{ours}.weight")] = (
                    Part(f"{b}{theirs}.weight", shape, transposed=True),
                )
                out[layer_key(i, f"{ours}.bias")] = (Part(f"{b}{theirs}.bias", (shape[1],)),)
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                for part in ("weight", "bias"):
                    out[layer_key(i, f"{ours}.{part}")] = (Part(f"{b}{theirs}.{part}", (h,)),)
        return out

    return Layout(config, recipes)


# --- BERT --------------------------------------------------------------------


def _bert(raw: Mapping[str, Any]) -> Layout:
    arch = _architecture(
        raw,
        (
            "BertModel",
            "BertForSequenceClassification",
            "BertForMaskedLM",
            "BertForPreTraining",
            "BertForTokenClassification",
        ),
    )
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"BERT activation must be 'gelu' (erf), got {raw.get('hidden_act')!r}")
    position_type = raw.get("position_embedding_type") or "absolute"
    if position_type != "absolute":
        raise ConfigError(f"BERT position embeddings must be 'absolute', got {position_type!r}")
    classes = 0
    if arch == "BertForSequenceClassification":
        labels = raw.get("id2label")
        default = len(labels) if isinstance(labels, dict) else 2
        classes = _int(raw, "num_labels", default)
    config = _bounded(
        {
            "kind": "encoder",
            "layers": _int(raw, "num_hidden_layers", 12),
            "hidden": _int(raw, "hidden_size", 768),
            "heads": _int(raw, "num_attention_heads", 12),
            "ffn": _int(raw, "intermediate_size", 3072),
            "vocab_size": _int(raw, "vocab_size", 30522),
            "max_positions": _int(raw, "max_position_embeddings", 512),
            "ln_eps": _float(raw, "layer_norm_eps", 1e-12),
            "num_classes": classes,
        }
    )
    types = _int(raw, "type_vocab_size", 2)
    if not 1 <= types <= 1024:
        raise ConfigError(f"config.json type_vocab_size must be in [1, 1024], got {types}")

    def recipes(names: Container[str]) -> dict[str, Recipe]:
        p = _prefix(names, "embeddings.word_embeddings.weight", ("bert.", ""))
        h, e = config.hidden, f"{p}embeddings."
        shapes = expected_shapes(config)
        out: dict[str, Recipe] = {
            "embed.token": (Part(f"{e}word_embeddings.weight", (config.vocab_size, h)),),
            # token type 0 folded into the positions: serving needs no segment ids
            "embed.position": (
                Part(f"{e}position_embeddings.weight", (config.max_positions, h)),
                Part(f"{e}token_type_embeddings.weight", (types, h), first_row=True),
            ),
            "embed.norm.weight": (Part(f"{e}LayerNorm.weight", (h,)),),
            "embed.norm.bias": (Part(f"{e}LayerNorm.bias", (h,)),),
        }
        for i in range(config.layers):
            for ours, theirs in BERT_LAYER_NAMES.items():
                for part in ("weight", "bias"):
                    key = layer_key(i, f"{ours}.{part}")
                    out[key] = (Part(f"{p}encoder.layer.{i}.{theirs}.{part}", shapes[key]),)
        if config.num_classes:
            for ours, theirs in (("pool", "bert.pooler.dense"), ("classify", "classifier")):
                for part in ("weight", "bias"):
                    key = f"{ours}.{part}"
                    out[key] = (Part(f"{theirs}.{part}", shapes[key]),)
        return out

    return Layout(config, recipes)


# --- Llama, Mistral, Qwen2 -----------------------------------------------------

_LLAMA_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
_LLAMA_VOCAB = {"llama": 32000, "mistral": 32000, "qwen2": 151936}


def _rope_theta(raw: Mapping[str, Any]) -> float:
    """The rotary base, refusing scaled RoPE we do not compute.

    transformers 5 keeps it in `rope_parameters`; earlier versions in
    `rope_theta`, with any scaling in `rope_scaling`.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json rope parameters must be a mapping, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"rotary scaling {kind!r} is not computed; only plain RoPE is")
    return _float(params, "rope_theta", _float(raw, "rope_theta", 10000.0))


def _llama(raw: Mapping[str, Any]) -> Layout:
    model_type = str(raw["model_type"])
    name = _LLAMA_CLASSES[model_type]
    arch = _architecture(raw, (f"{name}ForCausalLM", f"{name}Model"))
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name} activation must be 'silu', got {raw.get('hidden_act')!r}")
    hidden, heads = _int(raw, "hidden_size", 4096), _int(raw, "num_attention_heads", 32)
    if raw.get("head_dim") is not None and _int(raw, "head_dim") * heads != hidden:
        raise ConfigError(
            f"head_dim {raw['head_dim']} times {heads} heads must be the hidden size {hidden}"
        )
    if (raw.get("pretraining_tp") or 1) != 1:
        raise ConfigError(f"pretraining_tp must be 1, got {raw['pretraining_tp']!r}")
    # rotary positions have no table: a longer context is served up to the longest prompt
    positions = min(_int(raw, "max_position_embeddings", 2048), MAX_PROMPT_TOKENS)
    window = raw.get("sliding_window", 4096 if model_type == "mistral" else None)
    if window is not None and _flag(raw, "use_sliding_window", model_type != "qwen2"):
        # a sequence no longer than the window never meets its mask: serve only those
        positions = min(positions, _int(raw, "sliding_window"))
    attention_bias = _flag(raw, "attention_bias", False)
    qwen = model_type == "qwen2"
    kv = raw.get("num_key_value_heads")
    config = _bounded(
        {
            "kind": "decoder",
            "layers": _int(raw, "num_hidden_layers", 32),
            "hidden": hidden,
            "heads": heads,
            "ffn": _int(raw, "intermediate_size", 11008),
            "vocab_size": _int(raw, "vocab_size", _LLAMA_VOCAB[model_type]),
            "max_positions": positions,
            "ln_eps": _float(raw, "rms_norm_eps", 1e-6),
            "kv_heads": heads if kv is None else _int(raw, "num_key_value_heads"),
            "norm": "rms",
            "positions": "rope",
            "rope_theta": _rope_theta(raw),
            "mlp": "swiglu",
            "qkv_bias": qwen or attention_bias,
            "o_bias": attention_bias and not qwen,
            "mlp_bias": _flag(raw, "mlp_bias", False),
            # the bare model has no head: its logits come through the embedding
            "tied_head": _flag(raw, "tie_word_embeddings", False) or arch.endswith("Model"),
        }
    )

    def recipes(names: Container[str]) -> dict[str, Recipe]:
        p = _prefix(names, "embed_tokens.weight", ("model.", ""))
        shapes = expected_shapes(config)
        out: dict[str, Recipe] = {
            "embed.token": (Part(f"{p}embed_tokens.weight", shapes["embed.token"]),),
            "final_norm.weight": (Part(f"{p}norm.weight", shapes["final_norm.weight"]),),
        }
        if "lm_head.weight" in shapes:
            out["lm_head.weight"] = (Part("lm_head.weight", shapes["lm_head.weight"]),)
        for i in range(config.layers):
            for ours, theirs in LLAMA_LAYER_NAMES.items():
                for part in ("weight", "bias"):
                    key = layer_key(i, f"{ours}.{part}")
                    if key in shapes:
                        out[key] = (Part(f"{p}layers.{i}.{theirs}.{part}", shapes[key]),)
        return out

    return Layout(config, recipes)


MODEL_TYPES: dict[str, Callable[[Mapping[str, Any]], Layout]] = {
    "gpt2": _gpt2,
    "bert": _bert,
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
}
"""Each `model_type` of config.json we serve, and how to read its folder."""


def layout_of(raw: Mapping[str, Any]) -> Layout:
    """The layout of a folder whose config.json holds `raw`.

    Raises:
        ConfigError: Naming an unknown `model_type`, or the field we cannot serve.

    """
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json model_type must be one of {sorted(MODEL_TYPES)}, got {model_type!r}"
        )
    return MODEL_TYPES[model_type](raw)
