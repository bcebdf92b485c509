"""Each zoo model's options and size, read from its spec alone: no torch, no build.

A job's model is sized while the job is decoded (`common.job`), by services and by
the CLI alike, so this is the part of every model that must not import torch: the
knobs it accepts with their ceilings, its architecture table, and its parameter
count. Each model's builder (`common.zoo.<model>`) reads the same knobs and tables
from here, and a test holds each count to a real build.
"""

import math
from collections.abc import Callable

from common.errors import ConfigError
from common.zoo._count import conv, conv_bn, layer_norm, linear, make_divisible
from common.zoo._options import Options
from common.zoo._types import IMAGE_SHAPE, ModelSpec
from common.zoo.custom import check_custom_options, is_custom_name

__all__ = [
    "BASIC_EXPANSION",
    "BOTTLENECK_EXPANSION",
    "CNN_MAX_WIDTH",
    "EFFICIENTNET_DEPTH_MULT",
    "EFFICIENTNET_STAGES",
    "EFFICIENTNET_WIDTH_MULT",
    "MLP_MAX_DEPTH",
    "MLP_MAX_HIDDEN",
    "MOBILENET_MAX_WIDTH_MULT",
    "MOBILENET_SETTINGS",
    "RESNET18",
    "RESNET50",
    "RESNET_PLANES",
    "bert_options",
    "cnn_width",
    "fl_cnn_options",
    "mlp_options",
    "mobilenet_width_mult",
    "model_names",
    "parameter_count",
]

# -- mlp ---------------------------------------------------------------------------

MLP_MAX_HIDDEN = 1 << 16
"""Widest hidden layer: 16x the widest MLP layers of the models people train on edge devices."""

MLP_MAX_DEPTH = 1024
"""Most hidden layers: every layer is a unit the planner places, so far beyond any plan."""


def mlp_options(spec: ModelSpec) -> tuple[int, int]:
    """``(hidden, depth)`` of an mlp spec, each under its ceiling."""
    opts = Options(spec, {"hidden", "depth"})
    hidden = opts.get_int("hidden", 256, maximum=MLP_MAX_HIDDEN)
    depth = opts.get_int("depth", 3, minimum=0, maximum=MLP_MAX_DEPTH)
    return hidden, depth


def _count_mlp(spec: ModelSpec) -> int:
    hidden, depth = mlp_options(spec)
    in_features = math.prod(IMAGE_SHAPE)
    if depth == 0:
        return linear(in_features, spec.num_classes)
    body = linear(in_features, hidden) + (depth - 1) * linear(hidden, hidden)
    return body + linear(hidden, spec.num_classes)


# -- small_cnn ---------------------------------------------------------------------

CNN_MAX_WIDTH = 4096
"""Widest first conv (the last has 4x, the hidden layer 8x): 128x the default."""


def cnn_width(spec: ModelSpec) -> int:
    """The first conv's channels of a small_cnn spec."""
    return Options(spec, {"width"}).get_int("width", 32, maximum=CNN_MAX_WIDTH)


def _count_small_cnn(spec: ModelSpec) -> int:
    w = cnn_width(spec)
    channels, height, width = IMAGE_SHAPE
    flat = 4 * w * (height // 8) * (width // 8)
    convs = conv(channels, w, 3) + conv(w, w, 3) + conv(w, 2 * w, 3)
    convs += conv(2 * w, 2 * w, 3) + conv(2 * w, 4 * w, 3)
    return convs + linear(flat, 8 * w) + linear(8 * w, spec.num_classes)


# -- bert_small --------------------------------------------------------------------

_BERT_MAX_VOCAB = 1 << 20  # 4x the largest tokenizers in use (262144 ids)
_BERT_MAX_SEQ_LEN = 1 << 16
_BERT_MAX_HIDDEN = 1 << 14
_BERT_MAX_LAYERS = 512
_BERT_MAX_HEADS = 1024
_BERT_MAX_FFN = 1 << 17


def bert_options(spec: ModelSpec) -> tuple[int, int, int, int, int, int]:
    """``(vocab_size, seq_len, hidden, layers, heads, ffn)``, each under its ceiling."""
    opts = Options(spec, {"vocab_size", "seq_len", "hidden", "layers", "heads", "ffn"})
    vocab_size = opts.get_int("vocab_size", 1000, maximum=_BERT_MAX_VOCAB)
    seq_len = opts.get_int("seq_len", 64, maximum=_BERT_MAX_SEQ_LEN)
    hidden = opts.get_int("hidden", 512, maximum=_BERT_MAX_HIDDEN)
    depth = opts.get_int("layers", 4, maximum=_BERT_MAX_LAYERS)
    heads = opts.get_int("heads", 8, maximum=_BERT_MAX_HEADS)
    ffn = opts.get_int("ffn", 4 * hidden, maximum=_BERT_MAX_FFN)
    if hidden % heads:
        raise ConfigError(
            f"model {spec.name!r}: options.hidden ({hidden}) must be divisible by "
            f"options.heads ({heads})"
        )
    return vocab_size, seq_len, hidden, depth, heads, ffn


def _count_bert_small(spec: ModelSpec) -> int:
    vocab_size, seq_len, hidden, depth, _, ffn = bert_options(spec)
    embeddings = (vocab_size + seq_len) * hidden + layer_norm(hidden)
    attention = 4 * linear(hidden, hidden) + layer_norm(hidden)
    mlp = linear(hidden, ffn) + linear(ffn, hidden) + layer_norm(hidden)
    head = linear(hidden, hidden) + linear(hidden, spec.num_classes)
    return embeddings + depth * (attention + mlp) + head


# -- fl_cnn ------------------------------------------------------------------------

_FL_MAX_CHANNELS = 1024
_FL_MAX_SIZE = 1024
_FL_MAX_WIDTH = 4096
_FL_MAX_HIDDEN = 1 << 16


def fl_cnn_options(spec: ModelSpec) -> tuple[int, int, int, int]:
    """``(channels, size, width, hidden)``, each bounded far beyond FedAvg's CNN."""
    opts = Options(spec, {"channels", "size", "width", "hidden"})
    channels = opts.get_int("channels", 3, maximum=_FL_MAX_CHANNELS)
    size = opts.get_int("size", 32, minimum=4, maximum=_FL_MAX_SIZE)
    width = opts.get_int("width", 32, maximum=_FL_MAX_WIDTH)
    hidden = opts.get_int("hidden", 512, maximum=_FL_MAX_HIDDEN)
    if size % 4:
        raise opts.error("size", "a multiple of 4 (two 2x2 poolings)", size)
    return channels, size, width, hidden


def _count_fl_cnn(spec: ModelSpec) -> int:
    channels, size, width, hidden = fl_cnn_options(spec)
    flat = 2 * width * (size // 4) ** 2
    convs = conv(channels, width, 5) + conv(width, 2 * width, 5)
    return convs + linear(flat, hidden) + linear(hidden, spec.num_classes)


# -- mobilenet_v2 ------------------------------------------------------------------

MOBILENET_MAX_WIDTH_MULT = 16.0
"""Widest scaling: 16x (about 560 M parameters), far beyond the published 1.4."""

MOBILENET_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
"""(expansion t, output channels c, repeats n, first stride s), CIFAR strides."""


def mobilenet_width_mult(spec: ModelSpec) -> float:
    """The width multiplier of a mobilenet_v2 spec."""
    opts = Options(spec, {"width_mult"})
    return opts.get_float("width_mult", 1.0, maximum=MOBILENET_MAX_WIDTH_MULT)


def _count_inverted_residual(in_channels: int, out_channels: int, expand: int) -> int:
    hidden = round(in_channels * expand)
    expansion = conv_bn(in_channels, hidden, 1) if expand != 1 else 0
    return expansion + conv_bn(hidden, hidden, 3, groups=hidden) + conv_bn(hidden, out_channels, 1)


def _count_mobilenet_v2(spec: ModelSpec) -> int:
    width_mult = mobilenet_width_mult(spec)
    channels = make_divisible(32 * width_mult)
    last_channels = make_divisible(1280 * max(1.0, width_mult))
    total = conv_bn(IMAGE_SHAPE[0], channels, 3)
    for expand, c, repeats, _ in MOBILENET_SETTINGS:
        out_channels = make_divisible(c * width_mult)
        for _ in range(repeats):
            total += _count_inverted_residual(channels, out_channels, expand)
            channels = out_channels
    total += conv_bn(channels, last_channels, 1)
    return total + linear(last_channels, spec.num_classes)


# -- efficientnet_b1 ---------------------------------------------------------------

EFFICIENTNET_WIDTH_MULT = 1.0
EFFICIENTNET_DEPTH_MULT = 1.1

EFFICIENTNET_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 3, 1, 16, 1),
    (6, 3, 1, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)
"""(expansion, kernel, first stride, output channels, B0 repeats), CIFAR strides."""


def _count_mbconv(in_channels: int, out_channels: int, kernel: int, expand: int) -> int:
    hidden = make_divisible(in_channels * expand)
    squeezed = max(1, in_channels // 4)
    expansion = conv_bn(in_channels, hidden, 1) if hidden != in_channels else 0
    depthwise = conv_bn(hidden, hidden, kernel, groups=hidden)
    excitation = conv(hidden, squeezed, 1) + conv(squeezed, hidden, 1)
    return expansion + depthwise + excitation + conv_bn(hidden, out_channels, 1)


def _count_efficientnet_b1(spec: ModelSpec) -> int:
    Options(spec, set())
    channels = make_divisible(32 * EFFICIENTNET_WIDTH_MULT)
    total = conv_bn(IMAGE_SHAPE[0], channels, 3)
    for expand, kernel, _, c, repeats in EFFICIENTNET_STAGES:
        out_channels = make_divisible(c * EFFICIENTNET_WIDTH_MULT)
        for _ in range(math.ceil(repeats * EFFICIENTNET_DEPTH_MULT)):
            total += _count_mbconv(channels, out_channels, kernel, expand)
            channels = out_channels
    total += conv_bn(channels, 4 * channels, 1)
    return total + linear(4 * channels, spec.num_classes)


# -- resnet18, resnet50 ------------------------------------------------------------

RESNET_PLANES = (64, 128, 256, 512)
RESNET18 = (2, 2, 2, 2)
RESNET50 = (3, 4, 6, 3)
BASIC_EXPANSION = 1
"""Output channels per plane of a basic block (`common.zoo.resnet.BasicBlock`)."""
BOTTLENECK_EXPANSION = 4
"""Output channels per plane of a bottleneck block (`common.zoo.resnet.Bottleneck`)."""


def _count_resnet_block(bottleneck: bool, in_channels: int, planes: int, stride: int) -> int:
    out_channels = planes * (BOTTLENECK_EXPANSION if bottleneck else BASIC_EXPANSION)
    if bottleneck:
        body = conv_bn(in_channels, planes, 1) + conv_bn(planes, planes, 3)
        body += conv_bn(planes, out_channels, 1)
    else:
        body = conv_bn(in_channels, planes, 3) + conv_bn(planes, planes, 3)
    if stride != 1 or in_channels != out_channels:
        body += conv_bn(in_channels, out_channels, 1)
    return body


def _count_resnet(spec: ModelSpec, bottleneck: bool, repeats: tuple[int, ...]) -> int:
    Options(spec, set())
    total = conv_bn(IMAGE_SHAPE[0], 64, 3)
    channels = 64
    for stage, (planes, n) in enumerate(zip(RESNET_PLANES, repeats, strict=True)):
        for i in range(n):
            stride = 2 if stage > 0 and i == 0 else 1
            total += _count_resnet_block(bottleneck, channels, planes, stride)
            channels = planes * (BOTTLENECK_EXPANSION if bottleneck else BASIC_EXPANSION)
    return total + linear(channels, spec.num_classes)


# -- the zoo -----------------------------------------------------------------------

_COUNTERS: dict[str, Callable[[ModelSpec], int]] = {
    "bert_small": _count_bert_small,
    "efficientnet_b1": _count_efficientnet_b1,
    "fl_cnn": _count_fl_cnn,
    "mlp": _count_mlp,
    "mobilenet_v2": _count_mobilenet_v2,
    "resnet18": lambda spec: _count_resnet(spec, False, RESNET18),
    "resnet50": lambda spec: _count_resnet(spec, True, RESNET50),
    "small_cnn": _count_small_cnn,
}
"""Every zoo model by name; `common.zoo._registry` has a builder for each."""


def model_names() -> list[str]:
    """Return the zoo's model names, sorted."""
    return sorted(_COUNTERS)


def parameter_count(spec: ModelSpec) -> int | None:
    """The parameters the spec's model would have, from its options alone; no build.

    Checks every option against its ceiling on the way. A ``module:factory`` model's
    size is known only by running its factory, so it gives None (its input options are
    still checked, and no module is imported).

    Raises:
        ConfigError: Unknown model name, or an option of the wrong type or out of bounds.

    """
    if spec.num_classes < 1:
        raise ConfigError(f"model {spec.name!r}: num_classes must be >= 1, got {spec.num_classes}")
    if is_custom_name(spec.name):
        check_custom_options(spec)
        return None
    counter = _COUNTERS.get(spec.name)
    if counter is None:
        raise ConfigError(
            f"unknown model name {spec.name!r}: expected one of {', '.join(model_names())} "
            "or 'package.module:factory'"
        )
    return counter(spec)
