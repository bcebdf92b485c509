"""``init_from``: a job starts from a safetensors file of the whole model's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.errors import DataPathError
from common.init_weights import InitPathError, WeightsMismatch, init_header, load_init, mismatch
from common.zoo import ModelSpec, build_model

CNN = ModelSpec(name="small_cnn")


def saved(tmp_path: Path, seed: int = 11, **changes: torch.Tensor | None) -> Path:
    state = dict(build_model(CNN, seed).full().state_dict())
    for name, value in changes.items():
        if value is None:
            del state[name]
        else:
            state[name] = value
    path = tmp_path / "init.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def test_load_init_gives_the_file_s_weights(tmp_path: Path) -> None:
    path = saved(tmp_path)
    net = build_model(CNN, 0).full()
    load_init(path, net)
    want = build_model(CNN, 11).full().state_dict()
    got = net.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_half_precision_file_is_converted(tmp_path: Path) -> None:
    state = build_model(CNN, 11).full().state_dict()
    path = tmp_path / "half.safetensors"
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, str(path))
    net = build_model(CNN, 0).full()
    load_init(path, net)
    key = next(iter(state))
    assert torch.equal(net.state_dict()[key], state[key].half().float())


def test_mismatch_names_the_first_differing_tensors(tmp_path: Path) -> None:
    net = build_model(CNN, 0).full()
    names = list(net.state_dict())
    path = saved(
        tmp_path,
        **{names[0]: torch.zeros(2, 2), names[1]: None, "extra.weight": torch.zeros(1)},
    )
    with pytest.raises(WeightsMismatch) as caught:
        load_init(path, net)
    text = str(caught.value)
    assert f"missing: {names[1]}" in text
    assert "not in the model: extra.weight" in text
    assert f"shape: {names[0]} [2, 2]" in text


def test_mismatch_lists_a_few_and_counts_the_rest() -> None:
    model = {f"{i}.weight": (1,) for i in range(10)}
    text = mismatch({}, model)
    assert text is not None and "and 6 more" in text
    assert mismatch(model, model) is None


def test_unreadable_files_are_one_public_sentence(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    for path in (tmp_path / "absent.safetensors", tmp_path / "junk.safetensors", tmp_path / "w.pt"):
        with pytest.raises(InitPathError) as caught:
            init_header(path)
        assert isinstance(caught.value, DataPathError)
        assert str(caught.value) == InitPathError.PUBLIC and str(path) in caught.value.detail


def test_integer_buffer_must_stay_integer(tmp_path: Path) -> None:
    spec = ModelSpec(name="resnet18", num_classes=10)
    model = build_model(spec, 0).full()
    state = dict(model.state_dict())
    tracked = next(k for k in state if k.endswith("num_batches_tracked"))
    state[tracked] = torch.zeros((), dtype=torch.float32)
    path = tmp_path / "bn.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(WeightsMismatch, match=f"{tracked} is torch.float32"):
        load_init(path, model)
