"""Every model option has a ceiling, and a zoo model's size is counted without building it.

The counts are held to real builds (the plain way: build, sum ``numel``); the ceilings
to what the repository's own jobs, examples and benchmarks use; the job model refuses
what is out of bounds while a message is decoded, naming option, bound and value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from common.errors import ConfigError
from common.job import MAX_PARAMETERS, JobSpec
from common.zoo import ModelSpec, build_model, model_names, parameter_count

ROOT = Path(__file__).resolve().parents[2]

SMALL_OPTIONS: list[tuple[str, dict[str, int | float]]] = [
    ("mlp", {"depth": 0}),
    ("mlp", {"depth": 1, "hidden": 8}),
    ("mlp", {"depth": 5, "hidden": 30}),
    ("small_cnn", {"width": 4}),
    ("fl_cnn", {"channels": 1, "size": 8, "width": 16, "hidden": 64}),
    ("bert_small", {"vocab_size": 50, "seq_len": 16, "hidden": 48, "heads": 6, "layers": 2}),
    ("bert_small", {"vocab_size": 100, "seq_len": 8, "hidden": 32, "layers": 1, "ffn": 20}),
    ("mobilenet_v2", {"width_mult": 0.1}),
    ("mobilenet_v2", {"width_mult": 0.5}),
    ("mobilenet_v2", {"width_mult": 1.4}),
]


def built_parameters(spec: ModelSpec) -> int:
    model = build_model(spec, seed=0)
    return sum(p.numel() for layer in model.layers for p in layer.parameters())


@pytest.mark.parametrize("name", model_names())
@pytest.mark.parametrize("num_classes", [10, 3])
def test_the_count_of_every_zoo_model_at_its_defaults_is_what_a_build_allocates(name, num_classes):
    spec = ModelSpec(name=name, num_classes=num_classes)
    assert parameter_count(spec) == built_parameters(spec)


@pytest.mark.parametrize(("name", "options"), SMALL_OPTIONS)
def test_the_count_follows_the_options(name, options):
    spec = ModelSpec(name=name, options=options, num_classes=7)
    assert parameter_count(spec) == built_parameters(spec)


def test_a_custom_model_is_not_counted_and_not_imported():
    spec = ModelSpec(name="no_such_module_xyz:factory", options={"input_shape": "1x28x28"})
    assert parameter_count(spec) is None


@pytest.mark.parametrize(
    ("name", "option", "value", "bound"),
    [
        ("mlp", "depth", 300_000, "[0, 1024]"),
        ("mlp", "hidden", 300_000, "[1, 65536]"),
        ("small_cnn", "width", 10**6, "[1, 4096]"),
        ("fl_cnn", "channels", 5000, "[1, 1024]"),
        ("fl_cnn", "size", 4096, "[4, 1024]"),
        ("fl_cnn", "width", 5000, "[1, 4096]"),
        ("fl_cnn", "hidden", 10**6, "[1, 65536]"),
        ("bert_small", "vocab_size", 1 << 30, "[1, 1048576]"),
        ("bert_small", "seq_len", 1 << 20, "[1, 65536]"),
        ("bert_small", "hidden", 1 << 15, "[1, 16384]"),
        ("bert_small", "layers", 10_000, "[1, 512]"),
        ("bert_small", "heads", 4096, "[1, 1024]"),
        ("bert_small", "ffn", 1 << 20, "[1, 131072]"),
        ("mobilenet_v2", "width_mult", 1e9, "(0, 16]"),
        ("x.y:factory", "vocab_size", 1 << 30, "[1, 1048576]"),
    ],
)
def test_an_option_beyond_its_ceiling_is_refused_by_the_job_naming_bound_and_value(
    name, option, value, bound
):
    options = {option: value}
    if name.endswith(":factory"):
        options["input_kind"] = "tokens"
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"model": {"name": name, "options": options}})
    error = info.value.errors()[0]
    assert error["loc"] == ("model",)
    assert f"options.{option} must be " in error["msg"]
    assert bound in error["msg"] and repr(value) in error["msg"], error["msg"]


@pytest.mark.parametrize(
    "shape", ["100000x100000", "2x2x2x2x2x2x2x2x2", "9999999999", 1 << 40, "0x4"]
)
def test_a_custom_input_shape_is_bounded_before_anything_is_imported(shape):
    with pytest.raises(ValidationError, match=r"options\.input_shape must be a shape"):
        JobSpec.model_validate(
            {"model": {"name": "no_such_module_xyz:f", "options": {"input_shape": shape}}}
        )


def test_a_model_within_every_ceiling_but_too_big_is_refused_by_its_count():
    options = {"hidden": 65536, "depth": 1024}
    count = 3072 * 65536 + 65536 + 1023 * (65536 * 65536 + 65536) + 65536 * 10 + 10
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"model": {"name": "mlp", "options": options}})
    assert info.value.errors()[0]["loc"] == ("model",)
    assert f"model 'mlp' would have {count} parameters" in str(info.value)
    assert f"at most {MAX_PARAMETERS} (4 GiB) are allowed" in str(info.value)


def test_the_widest_one_layer_mlp_is_accepted():
    options = {"hidden": 65536, "depth": 1}
    spec = JobSpec.model_validate({"model": {"name": "mlp", "options": options}})
    assert parameter_count(spec.model) == (3072 + 1) * 65536 + (65536 + 1) * 10


def test_an_unknown_name_is_refused_with_the_list_of_names():
    with pytest.raises(ConfigError, match="unknown model name 'nope'"):
        parameter_count(ModelSpec(name="nope"))


def _job_files() -> list[Path]:
    roots = [ROOT / "services" / "cli" / "examples", ROOT / "deploy", ROOT / "tests"]
    files = [p for r in roots for p in r.rglob("*.y*ml") if p.suffix in (".yaml", ".yml")]
    jobs = []
    for path in files:
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue
        if (
            isinstance(data, dict)
            and isinstance(data.get("model"), dict)
            and "name" in data["model"]
        ):
            jobs.append(path)
    return jobs


def test_every_job_file_in_the_repository_is_within_bounds():
    files = _job_files()
    assert any(p.name == "job-demo.yaml" for p in files)
    for path in files:
        data = yaml.safe_load(path.read_text())
        if "serve_id" in data or "federation_id" in data:
            continue
        JobSpec.model_validate(data)
