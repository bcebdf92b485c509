"""The served weights a device builds from a serving spec, and the part of them it keeps.

Every device builds its weights from the same source (a seeded random
initialisation, a seeded `transformers` model, a training checkpoint, or a
model folder on its disk), so no weights cross the network at load time, and
keeps only its shard: under a weight-splitting plan a device holds its heads'
rows of Q and columns of O, its KV groups' rows of K and V, and its MLP columns
of `gate`, `up` and `down` (`cut_of`), which is what lets a model too big for
any one device be served (Galaxy Eq. 5). A seeded initialisation is built
tensor by tensor (`init_shard`) and a folder is read slice by slice
(`pretrained.load_shard`), so the whole model never exists on a device; the
other two sources build it whole first (transformers builds whole models, and
a checkpoint is read whole).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from common.errors import ConfigError
from common.extras import require
from common.galaxy.config import TransformerConfig
from common.store import Store
from services.lib.galaxy.model import init_tensor
from services.lib.galaxy.weights import (
    expected_shapes,
    from_bert_small,
    from_transformers,
    llama_family_model,
)

__all__ = [
    "cut_of",
    "from_checkpoint",
    "init_shard",
    "shard",
    "transformers_model",
    "transformers_weights",
]


def transformers_model(config: TransformerConfig, seed: int) -> torch.nn.Module:
    """A `transformers` GPT-2 or Llama-family (decoder) or BERT (encoder) of this shape, seeded.

    Built from a configuration only: random weights, nothing downloaded.
    """
    transformers = require("transformers", "a model built by transformers")

    torch.manual_seed(seed)
    model: torch.nn.Module
    if config.positions == "rope":
        model = llama_family_model(config)
    elif config.kind == "decoder":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=config.layers,
                n_embd=config.hidden,
                n_head=config.heads,
                n_inner=config.ffn,
                vocab_size=config.vocab_size,
                n_positions=config.max_positions,
                layer_norm_epsilon=config.ln_eps,
                bos_token_id=None,
                eos_token_id=None,
            )
        )
    else:
        bert = transformers.BertConfig(
            num_hidden_layers=config.layers,
            hidden_size=config.hidden,
            num_attention_heads=config.heads,
            intermediate_size=config.ffn,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_positions,
            layer_norm_eps=config.ln_eps,
        )
        bert.num_labels = max(config.num_classes, 1)
        model = (
            transformers.BertForSequenceClassification(bert)
            if config.num_classes
            else transformers.BertModel(bert)
        )
    model.train(False)
    return model


def transformers_weights(config: TransformerConfig, seed: int) -> dict[str, Tensor]:
    """Our weights of `transformers_model(config, seed)`."""
    got, w = from_transformers(transformers_model(config, seed))
    if got != config:
        raise ConfigError(f"transformers built {got}, asked for {config}")
    return w


def from_checkpoint(
    store: Store, job: str, round_no: int | None = None
) -> tuple[TransformerConfig, dict[str, Tensor], int]:
    """The config and weights a `bert_small` training job committed, and the round.

    The round defaults to the newest committed checkpoint; the served weights
    are then exactly the trained ones (`asteroid export` writes the same).

    Raises:
        ConfigError: Unknown job, no committed checkpoint, or a model other than bert_small.

    """
    from services.lib.export import trained_model  # the zoo and checkpoints: only this source

    zoo, chosen = trained_model(store, job, round_no)
    config, w = from_bert_small(zoo)
    return config, w, chosen


_ROW_CUTS = ("q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias")
_FFN_ROW_CUTS = ("up.weight", "up.bias", "gate.weight", "gate.bias")
_WHOLE = slice(None)


def cut_of(name: str, config: TransformerConfig, heads: range, cols: range) -> tuple[slice, slice]:
    """The rows and columns of model tensor `name` a device keeps for `heads` and MLP `cols`.

    One rule for every source: `shard` cuts a whole tensor with it, and a model
    folder is read through it slice by slice (`pretrained.load_shard`).
    """
    d = config.head_dim
    kind = name.split(".", 2)[2] if name.startswith("layers.") else ""  # "layers.3.q.weight"
    if kind in _ROW_CUTS:
        cut = heads if kind[0] == "q" else config.kv_range(heads)
        return slice(cut.start * d, cut.stop * d), _WHOLE
    if kind == "o.weight":
        return _WHOLE, slice(heads.start * d, heads.stop * d)
    if kind in _FFN_ROW_CUTS:
        return slice(cols.start, cols.stop), _WHOLE
    if kind == "down.weight":
        return _WHOLE, slice(cols.start, cols.stop)
    return _WHOLE, _WHOLE


def _cut(name: str, tensor: Tensor, config: TransformerConfig, heads: range, cols: range) -> Tensor:
    """The part of model tensor `name` a device keeps for `heads` and MLP `cols`."""
    rows, columns = cut_of(name, config, heads, cols)
    if rows == _WHOLE and columns == _WHOLE:
        return tensor
    return tensor[rows].clone() if columns == _WHOLE else tensor[:, columns].clone()


def shard(
    w: Mapping[str, Tensor], config: TransformerConfig, heads: range, cols: range
) -> dict[str, Tensor]:
    """The weights a device keeps for `heads` and MLP `cols`, re-indexed from 0.

    Q, K, V keep their heads' rows, O their columns; `up` keeps its rows for
    `cols`, `down` its columns. Every other tensor is kept whole. Slices are
    copied, so the full tensors can be freed.
    """
    return {name: _cut(name, t, config, heads, cols) for name, t in w.items()}


def init_shard(
    config: TransformerConfig, seed: int, heads: range, cols: range
) -> dict[str, Tensor]:
    """`shard(init_weights(config, seed), ...)` without ever holding the whole model.

    Tensor by tensor (`model.init_tensor`), so the peak is the shard plus one
    full tensor: a device serves its part of a model it could not hold whole.
    """
    return {
        name: _cut(name, init_tensor(name, shape, seed), config, heads, cols)
        for name, shape in expected_shapes(config).items()
    }
