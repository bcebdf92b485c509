"""A small BERT-style encoder classifier over integer token ids.

Attention is written out with plain matmuls (no fused kernels, no fast path) so that
train and eval modes compute the same function and results are reproducible. There is
no attention mask: synthetic sequences are always full length.
"""

import math
from collections import OrderedDict

import torch
from torch import nn

from common.zoo._model import InputSpec, ZooModel
from common.zoo._sizes import bert_options
from common.zoo._types import ModelSpec

__all__ = [
    "Embeddings",
    "EncoderLayer",
    "PoolerClassifier",
    "SelfAttention",
    "build_bert_small",
]

_LN_EPS = 1e-12  # BERT's LayerNorm epsilon
_INIT_STD = 0.02  # BERT's truncated-normal range, here a plain normal


class Embeddings(nn.Module):
    """Token plus learned position embeddings, then LayerNorm (no segment embedding)."""

    def __init__(self, vocab_size: int, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(seq_len, hidden)
        self.norm = nn.LayerNorm(hidden, eps=_LN_EPS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(B, T)`` to hidden states ``(B, T, hidden)``."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.norm(self.token(ids) + self.position(positions))
        return out


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention with an output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend every position to every position of the same sequence."""
        b, t, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        context = torch.matmul(scores.softmax(dim=-1), v)
        out: torch.Tensor = self.out(context.transpose(1, 2).reshape(b, t, h))
        return out


class EncoderLayer(nn.Module):
    """Post-LN transformer layer as in BERT: ``LN(x + attn(x))`` then ``LN(x + ffn(x))``."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden, eps=_LN_EPS)
        self.ffn = nn.Sequential(
            OrderedDict(up=nn.Linear(hidden, ffn), act=nn.GELU(), down=nn.Linear(ffn, hidden))
        )
        self.ffn_norm = nn.LayerNorm(hidden, eps=_LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transform hidden states ``(B, T, hidden)`` keeping their shape."""
        x = self.attention_norm(x + self.attention(x))
        out: torch.Tensor = self.ffn_norm(x + self.ffn(x))
        return out


class PoolerClassifier(nn.Module):
    """BERT's pooler (first token, dense, tanh) followed by a linear classifier."""

    def __init__(self, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map hidden states ``(B, T, hidden)`` to logits ``(B, num_classes)``."""
        out: torch.Tensor = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        return out


def _init_bert(layers: list[nn.Module]) -> None:
    """Initialise as BERT does: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=_INIT_STD)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def build_bert_small(spec: ModelSpec) -> ZooModel:
    """Build embeddings, ``layers`` encoder layers and the pooler+classifier.

    Six layers at the defaults. Options: ``vocab_size`` (1000), ``seq_len`` (64),
    ``hidden`` (512), ``layers`` (4), ``heads`` (8), ``ffn`` (4 * hidden); each has a
    ceiling (`common.zoo._sizes.bert_options`).
    """
    vocab_size, seq_len, hidden, depth, heads, ffn = bert_options(spec)

    layers: list[nn.Module] = [Embeddings(vocab_size, seq_len, hidden)]
    layers += [EncoderLayer(hidden, heads, ffn) for _ in range(depth)]
    layers.append(PoolerClassifier(hidden, spec.num_classes))
    _init_bert(layers)
    spec_in = InputSpec(kind="tokens", shape=(seq_len,), dtype=torch.int64, vocab_size=vocab_size)
    return ZooModel(layers, spec_in, spec.num_classes, has_batchnorm=False)
