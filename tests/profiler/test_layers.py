import math

import pytest
import torch
from torch import nn

from common.data import dataset_for, split_indices
from common.errors import ConfigError
from common.model_key import model_key
from common.profile import Profile
from common.zoo import ModelSpec, build_model
from services.profiler.layers import (
    HEADROOM,
    Step,
    auto_batch_sizes,
    profile_model,
)


def _reference_output_bytes(spec: ModelSpec, batch: int) -> list[int]:
    """Per-sample output bytes of each layer, from a plain forward of the whole model."""
    model = build_model(spec, 0)
    x = dataset_for(model, 0).batch(split_indices("train", 0, batch))[0]
    out = []
    with torch.no_grad():
        for layer in model.layers:
            x = layer(x)
            out.append(x.numel() * x.element_size() // batch)
    return out


@pytest.mark.parametrize("name", ["small_cnn", "mlp"])
def test_profile_matches_the_model(name):
    spec = ModelSpec(name=name)
    steps: list[Step] = []
    prof = profile_model(spec, [4, 1, 2], repeats=1, warmup=0, progress=steps.append)

    Profile.model_validate(prof.model_dump(mode="json"))  # survives a JSON round trip
    model = build_model(spec, 0)
    assert prof.model == model_key(spec)
    assert prof.batch_sizes == [1, 2, 4]
    assert len(prof.layers) == len(model.layers)
    assert prof.input_bytes == 3 * 32 * 32 * 4
    assert [s.done for s in steps] == list(range(1, 3 * len(model.layers) + 1))
    assert {s.total for s in steps} == {3 * len(model.layers)}
    assert [lp.output_bytes for lp in prof.layers] == _reference_output_bytes(spec, 4)
    for lp, layer in zip(prof.layers, model.layers, strict=True):
        assert all(t > 0 for t in lp.forward_s + lp.backward_s), lp
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        assert lp.param_bytes == params
        assert lp.optimizer_bytes == params  # SGD momentum: one buffer per parameter
        if any(isinstance(m, nn.Conv2d) for m in layer.modules()):
            # a convolution keeps at least its input, for the weight gradient
            inputs = prof.layers[lp.index - 1].output_bytes if lp.index else prof.input_bytes
            assert lp.activation_bytes >= inputs > 0


def test_time_grows_with_batch_size():
    prof = profile_model(ModelSpec(name="small_cnn"), [1, 128], repeats=3, warmup=1)
    small, large = (sum(lp.forward_s[j] + lp.backward_s[j] for lp in prof.layers) for j in (0, 1))
    assert large > 2 * small


def test_token_model_profiles_from_token_ids():
    prof = profile_model(ModelSpec(name="bert_small"), [2], repeats=1, warmup=0)
    first = prof.layers[0]
    assert prof.input_bytes == 64 * 8  # int64 token ids
    assert first.backward_s[0] > 0  # embedding weights get gradients
    assert first.activation_bytes > 0
    assert prof.layers[-1].output_bytes == 10 * 4


def test_adam_counts_two_state_buffers():
    prof = profile_model(ModelSpec(name="mlp"), [1], repeats=1, warmup=0, optimizer="adam")
    assert all(lp.optimizer_bytes == 2 * lp.param_bytes for lp in prof.layers)


def test_automatic_batch_sizes_follow_the_memory_budget():
    spec = ModelSpec(name="mlp")
    unbounded = profile_model(spec, None, repeats=1, warmup=0, max_batch=16)
    assert unbounded.batch_sizes == [1, 2, 4, 8, 16]
    params = sum(lp.param_bytes for lp in unbounded.layers)
    # room for the weights and their gradients, and for little else
    tight = profile_model(
        spec, None, repeats=1, warmup=0, memory_budget=int(2.1 * params / HEADROOM)
    )
    assert tight.batch_sizes[-1] < 16
    assert tight.memory_budget == int(2.1 * params / HEADROOM)


def test_auto_batch_sizes():
    assert auto_batch_sizes(per_sample=100, fixed=0, budget=0, cap=256) == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
    ]
    assert auto_batch_sizes(per_sample=100, fixed=0, budget=0, cap=100)[-1] == 64
    budget = int(1000 / HEADROOM)  # 1000 usable bytes
    assert auto_batch_sizes(per_sample=100, fixed=200, budget=budget) == [1, 2, 4, 8]
    assert auto_batch_sizes(per_sample=100, fixed=2000, budget=budget) == [1]  # never empty


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_sizes": [0, 2]}, "batch sizes must be >= 1"),
        ({"repeats": 0}, "repeats >= 1"),
        ({"optimizer": "lion"}, "optimizer must be one of"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        profile_model(ModelSpec(name="mlp"), **{"batch_sizes": [1], **kwargs})


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown model name"):
        profile_model(ModelSpec(name="nope"), [1])


def test_per_sample_bytes_do_not_depend_on_the_batch():
    spec = ModelSpec(name="small_cnn")
    one = profile_model(spec, [1], repeats=1, warmup=0)
    eight = profile_model(spec, [8], repeats=1, warmup=0)
    for a, b in zip(one.layers, eight.layers, strict=True):
        assert a.output_bytes == b.output_bytes
        assert math.isclose(a.activation_bytes, b.activation_bytes, rel_tol=0.05)


def test_calibration_scales_medians_up_to_whole_passes_never_down():
    from services.profiler.layers import _calibration

    layers = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    x = torch.randn(32, 64)
    tiny = [[1e-9] for _ in layers]
    assert _calibration(layers, x, tiny, [[1e-9] for _ in layers]) > 10
    huge = [[10.0] for _ in layers]
    assert _calibration(layers, x, huge, [[10.0] for _ in layers]) == 1.0
    assert all(p.grad is None for layer in layers for p in layer.parameters())
