"""Parameter counts of the zoo's building blocks, from their shapes alone.

A job's model is sized before it is built, so that a spec whose weights would not
fit is refused without allocating them; each model's ``count_*`` adds these up the
way its builder stacks the modules, and a test holds each count to a real build.
"""

__all__ = ["conv", "conv_bn", "layer_norm", "linear", "make_divisible"]


def linear(in_features: int, out_features: int, bias: bool = True) -> int:
    """Parameters of ``nn.Linear(in_features, out_features)``."""
    return in_features * out_features + (out_features if bias else 0)


def conv(
    in_channels: int, out_channels: int, kernel: int, groups: int = 1, bias: bool = True
) -> int:
    """Parameters of a square ``nn.Conv2d``."""
    weights = in_channels // groups * out_channels * kernel * kernel
    return weights + (out_channels if bias else 0)


def conv_bn(in_channels: int, out_channels: int, kernel: int, groups: int = 1) -> int:
    """Parameters of `ConvBNAct`: a bias-free conv and a batch-norm's weight and bias."""
    return conv(in_channels, out_channels, kernel, groups, bias=False) + 2 * out_channels


def layer_norm(features: int) -> int:
    """Parameters of ``nn.LayerNorm(features)``."""
    return 2 * features


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a scaled channel count to a multiple of ``divisor``, as MobileNet does.

    Never rounds down by more than 10%, so width scaling keeps its intended capacity.
    """
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded
