"""A small plain CNN (conv, SiLU, average pooling) without batch-norm.

Without batch-norm, micro-batched pipeline training equals single-device training up
to float round-off, which makes this the model of the exactness tests. Its
activations are smooth for the same reason: with ReLU, a round-off difference
(a batch of 32 against four of 8 takes other kernels on some CPUs) can flip an
activation near zero, and that flip turns 3e-8 into a jump of 2e-6 within three
SGD steps; with SiLU round-off stays round-off (6e-8 after 14 steps).
"""

from collections import OrderedDict

from torch import nn

from common.zoo._model import IMAGE_INPUT, ZooModel
from common.zoo._sizes import CNN_MAX_WIDTH as MAX_WIDTH
from common.zoo._sizes import cnn_width
from common.zoo._types import ModelSpec

__all__ = ["MAX_WIDTH", "build_small_cnn"]


def _conv(in_channels: int, out_channels: int, pool: bool) -> nn.Sequential:
    parts: OrderedDict[str, nn.Module] = OrderedDict(
        conv=nn.Conv2d(in_channels, out_channels, 3, padding=1),
        act=nn.SiLU(),
    )
    if pool:
        parts["pool"] = nn.AvgPool2d(2)
    return nn.Sequential(parts)


def build_small_cnn(spec: ModelSpec) -> ZooModel:
    """Build 5 conv layers (32->16->8->4 px), a hidden linear layer and a classifier.

    Seven layers, about 0.67 M parameters at the default width, so a few training rounds
    run in seconds on a CPU. Pooling averages rather than takes the maximum: on noisy
    synthetic images max-pooling amplifies the noise and made training erratic.
    Options: ``width`` (first conv's channels, default 32, at most `MAX_WIDTH`).
    """
    w = cnn_width(spec)
    channels, height, width = IMAGE_INPUT.shape
    flat = 4 * w * (height // 8) * (width // 8)
    hidden = 8 * w
    layers: list[nn.Module] = [
        _conv(channels, w, pool=False),
        _conv(w, w, pool=True),
        _conv(w, 2 * w, pool=False),
        _conv(2 * w, 2 * w, pool=True),
        _conv(2 * w, 4 * w, pool=True),
        nn.Sequential(OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(flat, hidden), act=nn.SiLU())),
        nn.Linear(hidden, spec.num_classes),
    ]
    _init_kaiming(layers)
    return ZooModel(layers, IMAGE_INPUT, spec.num_classes, has_batchnorm=False)


def _init_kaiming(layers: list[nn.Module]) -> None:
    """He (fan-in) initialisation with zero biases.

    Without batch-norm, PyTorch's default initialisation shrinks activations about
    six-fold per layer, and this seven-layer net then sits on a loss plateau for
    hundreds of steps; He initialisation keeps the signal and it learns at once.
    """
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
    # The classifier starts near zero: initial logits are small, the first loss is
    # about ln(classes), and momentum SGD at the usual rates does not diverge.
    classifier = layers[-1]
    if isinstance(classifier, nn.Linear):
        nn.init.normal_(classifier.weight, std=0.01)
