"""Tiny Hugging Face model folders for the pretrained tests, built here, nothing downloaded.

Each model is built by `transformers` from a small config, every parameter
perturbed (biases and norms too, so a mis-mapped tensor shows), and saved with
`save_pretrained` as safetensors: one file, or shards with an index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["bert", "gpt2", "llama", "save"]


def _perturb(model: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _transformers() -> Any:
    import transformers

    return transformers


def gpt2(seed: int = 1, heads: int = 4) -> nn.Module:
    """A 2-layer GPT2LMHeadModel (tied head), hidden 32."""
    t = _transformers()
    cfg = t.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=heads,
        vocab_size=61,
        n_positions=32,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    return _perturb(t.GPT2LMHeadModel(cfg), seed)


def bert(classes: int = 0, seed: int = 2) -> nn.Module:
    """A 2-layer BertModel, or BertForSequenceClassification with `classes` labels."""
    t = _transformers()
    cfg = t.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=61,
        max_position_embeddings=32,
        num_labels=max(classes, 2),
        attn_implementation="eager",
    )
    model = t.BertForSequenceClassification(cfg) if classes else t.BertModel(cfg)
    return _perturb(model, seed)


def llama(seed: int = 3, kv_heads: int = 2, tied: bool = False, model_type: str = "llama") -> Any:
    """A 2-layer LlamaForCausalLM (or Mistral, Qwen2): grouped-query attention, RoPE, hidden 32."""
    t = _transformers()
    fields: dict[str, Any] = {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "intermediate_size": 48,
        "vocab_size": 61,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "attn_implementation": "eager",
    }
    if model_type == "mistral":
        model = t.MistralForCausalLM(t.MistralConfig(sliding_window=None, **fields))
    elif model_type == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**fields))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(**fields))
    return _perturb(model, seed)


def save(
    model: nn.Module,
    folder: Path,
    shard_kb: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """`model.save_pretrained(folder)` as safetensors, in shards of `shard_kb` KiB if given."""
    if dtype is not None:
        model = model.to(dtype)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_kb is not None:
        kwargs["max_shard_size"] = f"{shard_kb}KB"
    model.save_pretrained(folder, **kwargs)  # type: ignore[operator]
    return folder
