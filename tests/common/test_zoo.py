import functools
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from common.errors import ConfigError, PlanError
from common.zoo import InputSpec, ModelSpec, ZooModel, build_model, model_factory, model_names
from common.zoo.bert import EncoderLayer

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_LAYERS = {
    "bert_small": 6,
    "fl_cnn": 4,
    "efficientnet_b1": 26,
    "mlp": 4,
    "mobilenet_v2": 20,
    "resnet18": 10,
    "resnet50": 18,
    "small_cnn": 7,
}
WITH_BATCHNORM = {"efficientnet_b1", "mobilenet_v2", "resnet18", "resnet50"}
FACTORIES = "zoo_test_factories"
ALLOWED = (FACTORIES, "no_such_module_xyz")  # as the model_modules setting lists them


@functools.cache
def cached_model(name: str) -> ZooModel:
    return build_model(ModelSpec(name=name), seed=0)


def sample_input(spec: InputSpec, batch: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if spec.kind == "tokens":
        assert spec.vocab_size is not None
        return torch.randint(0, spec.vocab_size, (batch, *spec.shape), generator=gen)
    return torch.randn(batch, *spec.shape, generator=gen)


def state_digest(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def test_model_names_lists_the_zoo() -> None:
    assert model_names() == sorted(EXPECTED_LAYERS)


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYERS))
def test_layer_count_and_flags(name: str) -> None:
    model = cached_model(name)
    assert len(model.layers) == EXPECTED_LAYERS[name]
    assert model.num_classes == 10
    assert model.has_batchnorm == (name in WITH_BATCHNORM)
    expected_kind = "tokens" if name == "bert_small" else "image"
    assert model.input.kind == expected_kind


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYERS))
def test_stages_compose_to_the_full_model(name: str) -> None:
    model = cached_model(name)
    n = len(model.layers)
    x = sample_input(model.input)
    full = model.full().eval()
    with torch.no_grad():
        expected = full(x)
        assert expected.shape == (2, 10)
        for k in sorted({1, n // 2, n - 1}):
            head, tail = model.stage(0, k).eval(), model.stage(k, n).eval()
            torch.testing.assert_close(tail(head(x)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYERS))
def test_forward_backward_reaches_every_parameter(name: str) -> None:
    model = build_model(ModelSpec(name=name), seed=1)
    net = model.full().train()
    logits = net(sample_input(model.input))
    loss = nn.functional.cross_entropy(logits, torch.tensor([0, 1]))
    loss.backward()
    for pname, p in net.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYERS))
def test_same_seed_same_weights_other_seed_different(name: str) -> None:
    spec = ModelSpec(name=name)
    a = state_digest(build_model(spec, seed=5).full().state_dict())
    b = state_digest(build_model(spec, seed=5).full().state_dict())
    c = state_digest(build_model(spec, seed=6).full().state_dict())
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def weights_sha256(names: list[str], seed: int) -> str:
    """Self-contained (its source also runs in a child process)."""
    import hashlib

    from common.zoo import ModelSpec, build_model

    digest = hashlib.sha256()
    for name in names:
        for key, value in build_model(ModelSpec(name=name), seed).full().state_dict().items():
            digest.update(key.encode())
            digest.update(value.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_weights_are_identical_in_a_fresh_process() -> None:
    names = ["mlp", "small_cnn", "bert_small", "mobilenet_v2"]
    script = "\n".join(
        [
            "import torch",
            "torch.set_num_threads(1)",
            "torch.manual_seed(123)",  # the caller's RNG state must not matter
            inspect.getsource(weights_sha256),
            f"print(weights_sha256({names!r}, 7))",
        ]
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    assert child.stdout.strip() == weights_sha256(names, 7)


def test_build_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    build_model(ModelSpec(name="mlp"), seed=3)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_stage_is_a_view_with_reindexed_keys() -> None:
    model = cached_model("resnet18")
    stage = model.stage(3, 6)
    assert len(stage) == 3
    keys = stage.state_dict().keys()
    for offset, layer in enumerate(model.layers[3:6]):
        assert {f"{offset}.{k}" for k in layer.state_dict()} <= keys
        assert stage[offset] is layer  # shared, not copied
    assert model.full().state_dict().keys() == {
        f"{i}.{k}" for i, layer in enumerate(model.layers) for k in layer.state_dict()
    }


@pytest.mark.parametrize(("start", "end"), [(0, 0), (2, 1), (-1, 2), (0, 11), (10, 11)])
def test_stage_rejects_bad_ranges(start: int, end: int) -> None:
    with pytest.raises(PlanError, match="0 <= start < end <= 10"):
        cached_model("resnet18").stage(start, end)


def test_bert_small_shape() -> None:
    model = cached_model("bert_small")
    encoders = [layer for layer in model.layers if isinstance(layer, EncoderLayer)]
    assert len(encoders) == 4
    for layer in encoders:
        assert layer.attention.heads == 8
        assert layer.attention.query.in_features == 512
        assert layer.ffn.up.out_features == 2048
    assert model.input == InputSpec("tokens", (64,), torch.int64, vocab_size=1000)


def test_bert_small_options() -> None:
    spec = ModelSpec(
        name="bert_small",
        num_classes=3,
        options={"vocab_size": 50, "seq_len": 8, "hidden": 32, "layers": 2, "heads": 4},
    )
    model = build_model(spec, seed=0)
    assert len(model.layers) == 4
    assert model.input.shape == (8,) and model.input.vocab_size == 50
    assert model.full()(sample_input(model.input)).shape == (2, 3)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (ModelSpec(name="resnet19"), "unknown model name 'resnet19'.*resnet18.*small_cnn"),
        (ModelSpec(name="mlp", options={"widht": 3}), r"unknown options \['widht'\]"),
        (ModelSpec(name="mlp", options={"hidden": 0}), "options.hidden must be an integer"),
        (ModelSpec(name="mlp", options={"hidden": True}), "options.hidden must be an integer"),
        (ModelSpec(name="mobilenet_v2", options={"width_mult": "big"}), "options.width_mult"),
        (ModelSpec(name="resnet50", options={"width": 2}), "accepted options: none"),
        (ModelSpec(name="bert_small", options={"hidden": 30}), "divisible by options.heads"),
        (ModelSpec(name="mlp", num_classes=0), "num_classes must be >= 1"),
    ],
)
def test_bad_specs_raise_config_error(spec: ModelSpec, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_model(spec, seed=0)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True])
def test_bad_seed_raises_config_error(seed: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        build_model(ModelSpec(name="mlp"), seed=seed)  # type: ignore[arg-type]


def test_model_spec_is_frozen_and_strict() -> None:
    spec = ModelSpec(name="mlp", options={"hidden": 8, "flag": True, "ratio": 0.5, "s": "x"})
    assert spec.options == {"hidden": 8, "flag": True, "ratio": 0.5, "s": "x"}
    assert type(spec.options["flag"]) is bool
    with pytest.raises(ValidationError):
        ModelSpec(name="mlp", colour="red")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        spec.name = "small_cnn"  # type: ignore[misc]


# --- custom models ---------------------------------------------------------------------


def _sequential() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.ReLU(), nn.Linear(16, 10))


def _token_layers() -> list[nn.Module]:
    return [nn.Embedding(50, 8), nn.Flatten(), nn.Linear(16 * 8, 10)]


def _zoo_model() -> ZooModel:
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(12, 4)]
    return ZooModel(layers, InputSpec("image", (3, 2, 2), torch.float32), 4, False)


def _shared() -> list[nn.Module]:
    linear = nn.Linear(4, 4)
    return [linear, nn.Sequential(linear)]


def _raises() -> nn.Sequential:
    raise RuntimeError("boom")


@pytest.fixture(autouse=True)
def factories(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType(FACTORIES)
    factories = {
        "sequential": _sequential,
        "token_layers": _token_layers,
        "zoo_model": _zoo_model,
        "shared": _shared,
        "raises": _raises,
        "identity": lambda: nn.Identity(),
        "empty": lambda: [],
        "mixed": lambda: [nn.ReLU(), "relu"],
    }
    module.__dict__.update({k: model_factory(f) for k, f in factories.items()})
    # a callable the module holds but never declared a factory, like a cache-clearing helper
    module.__dict__.update(not_callable=3, undeclared=lambda: _sequential())
    monkeypatch.setitem(sys.modules, FACTORIES, module)


def test_custom_sequential_defaults_to_cifar_images() -> None:
    model = build_model(ModelSpec(name=f"{FACTORIES}:sequential"), seed=0, allowed_modules=ALLOWED)
    assert len(model.layers) == 4
    assert model.input == InputSpec("image", (3, 32, 32), torch.float32)
    assert not model.has_batchnorm
    x = sample_input(model.input)
    torch.testing.assert_close(model.stage(2, 4)(model.stage(0, 2)(x)), model.full()(x))
    again = build_model(ModelSpec(name=f"{FACTORIES}:sequential"), seed=0, allowed_modules=ALLOWED)
    assert torch.equal(model.layers[1].weight, again.layers[1].weight)


def test_custom_list_with_token_input() -> None:
    spec = ModelSpec(
        name=f"{FACTORIES}:token_layers",
        options={"input_kind": "tokens", "input_shape": 16, "vocab_size": 50},
    )
    model = build_model(spec, seed=0, allowed_modules=ALLOWED)
    assert model.input == InputSpec("tokens", (16,), torch.int64, vocab_size=50)
    assert model.full()(sample_input(model.input)).shape == (2, 10)


def test_custom_image_shape_option() -> None:
    spec = ModelSpec(name=f"{FACTORIES}:sequential", options={"input_shape": "1x28x28"})
    assert build_model(spec, seed=0, allowed_modules=ALLOWED).input.shape == (1, 28, 28)


def test_custom_factory_may_return_a_zoo_model() -> None:
    model = build_model(
        ModelSpec(name=f"{FACTORIES}:zoo_model", num_classes=4), seed=0, allowed_modules=ALLOWED
    )
    assert model.input.shape == (3, 2, 2)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("no_such_module_xyz:factory", {}, "cannot import module 'no_such_module_xyz'"),
        (f"{FACTORIES}:missing", {}, "has no callable 'missing'"),
        (f"{FACTORIES}:not_callable", {}, "has no callable 'not_callable'"),
        (f"{FACTORIES}:undeclared", {}, "'undeclared' in module .* is not declared a model"),
        (f"{FACTORIES}:identity", {}, "got Identity"),
        (f"{FACTORIES}:mixed", {}, "got list"),
        (f"{FACTORIES}:empty", {}, "returned no layers"),
        (f"{FACTORIES}:raises", {}, "factory raised RuntimeError"),
        (f"{FACTORIES}:shared", {}, "layers 0 and 1 share a parameter"),
        (f"{FACTORIES}:zoo_model", {}, "num_classes is 10 but the factory's model has 4"),
        (f"{FACTORIES}:sequential", {"input_shape": "3xx"}, "options.input_shape"),
        (f"{FACTORIES}:sequential", {"input_kind": "audio"}, "options.input_kind"),
        (f"{FACTORIES}:sequential", {"vocab_size": 5}, "options.vocab_size"),
        (f"{FACTORIES}:sequential", {"depth": 5}, "unknown options"),
        (":factory", {}, "package.module:factory"),
        (f"{FACTORIES}:a:b", {}, "package.module:factory"),
    ],
)
def test_bad_custom_models_raise_config_error(
    name: str, options: dict[str, int | str], match: str
) -> None:
    spec = ModelSpec(name=name, options=options)
    with pytest.raises(ConfigError, match=match) as info:
        build_model(spec, seed=0, allowed_modules=ALLOWED)
    assert repr(name) in str(info.value)
