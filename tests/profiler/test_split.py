"""The profile of a device with two cores carries Duan & Wu's measured split gain; one core none."""

import math
import os

import pytest
import torch

from common.accelerator import AcceleratorInfo
from common.zoo import ModelSpec
from services.profiler import split
from services.profiler.layers import profile_model
from services.profiler.split import heaviest_range, with_device_split_gain

SPEC = ModelSpec(name="small_cnn")


@pytest.fixture(scope="module")
def profile():
    return profile_model(SPEC, [4, 16], repeats=2, warmup=1)


def test_the_measured_range_is_the_heaviest_stage_sized_run_of_layers(profile) -> None:
    lo, hi = heaviest_range(profile, micro=16, stages=4)
    width = math.ceil(len(profile.layers) / 4)
    assert hi - lo == width
    cost = [layer.forward_s[1] + layer.backward_s[1] for layer in profile.layers]
    sums = [sum(cost[i : i + width]) for i in range(len(cost) - width + 1)]
    assert sum(cost[lo:hi]) == max(sums)
    assert heaviest_range(profile, stages=1) == (0, len(profile.layers))


def test_a_profile_made_on_two_cores_carries_the_measured_split_gain(profile, monkeypatch) -> None:
    real = sorted(os.sched_getaffinity(0))
    if len(real) < 2:
        pytest.skip("the split is measured on two real cores")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(real[:2]))
    monkeypatch.setattr(split, "cpu_quota", lambda: None)
    threads = torch.get_num_threads()
    assert profile.split_gain is None
    got = with_device_split_gain(profile, SPEC)
    assert got.split_gain is not None and got.split_gain > -1.0
    assert got.model_copy(update={"split_gain": None}) == profile  # the rest unchanged
    assert torch.get_num_threads() == threads


def test_measured_gain_is_the_libraries_measurement_on_the_heaviest_range(
    profile, monkeypatch
) -> None:
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("the split is measured on two real cores")
    seen = {}
    real = split.measure_split_gain

    def measure(module, x, repeats, cores):
        seen.update(layers=len(module), micro=x.shape[0], cores=set(cores))
        return real(module, x, repeats=1, cores=cores)

    monkeypatch.setattr(split, "measure_split_gain", measure)
    got = with_device_split_gain(profile, SPEC, cores={0, 1})
    lo, hi = heaviest_range(profile)
    assert seen == {"layers": hi - lo, "micro": 16, "cores": {0, 1}}
    assert got.split_gain is not None


def test_a_cpu_quota_below_two_cores_gets_no_gain_and_no_measurement(profile, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})

    def measure(*args, **kwargs):
        raise AssertionError("measured under a quota the lanes cannot divide")

    monkeypatch.setattr(split, "measure_split_gain", measure)
    for quota in (0.177, 1.0, 1.99):
        monkeypatch.setattr(split, "cpu_quota", lambda q=quota: q)
        assert with_device_split_gain(profile, SPEC).split_gain is None


def test_one_core_or_a_gpu_gets_no_gain(profile, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert with_device_split_gain(profile, SPEC).split_gain is None
    gpu = AcceleratorInfo("cuda", "gpu", 0, 1 << 30, False)
    assert with_device_split_gain(profile, SPEC, cores={0, 1}, accelerator=gpu).split_gain is None
