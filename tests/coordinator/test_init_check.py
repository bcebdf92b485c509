"""A submitted job's ``init_from`` is checked against its model before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from common.init_weights import InitPathError, WeightsMismatch
from common.job import JobSpec
from common.zoo import ModelSpec, build_model
from services.coordinator.checks import check_job


def job(init: Path, name: str = "small_cnn") -> JobSpec:
    return JobSpec(model=ModelSpec(name=name), init_from=init, rounds=3)


def test_a_matching_file_passes_and_another_model_s_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    state = build_model(ModelSpec(name="small_cnn"), 5).full().state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    assert check_job(job(path)).rounds == 3
    with pytest.raises(WeightsMismatch, match=r"init_from: .*(missing|shape): 0\."):
        check_job(job(path, "mlp"))


def test_a_missing_file_is_one_public_sentence(tmp_path: Path) -> None:
    with pytest.raises(InitPathError) as caught:
        check_job(job(tmp_path / "absent.safetensors"))
    assert str(caught.value) == InitPathError.PUBLIC
