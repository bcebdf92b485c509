"""Accelerator choice, description and budget, decided on a CPU with CUDA's answers faked."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.accelerator import (
    CPU,
    accelerator_budget,
    choose_accelerator,
    describe_accelerator,
    full_precision,
)
from common.device import device_fingerprint
from common.errors import ConfigError
from common.messages import FINGERPRINT_PATTERN
from common.settings import ProfilerSettings, WorkerSettings
from services.coordinator.claims import facts

GiB = 1 << 30


def _fake_gpu(
    monkeypatch: pytest.MonkeyPatch,
    *,
    name: str = "NVIDIA GeForce RTX 4090",
    total: int = 24 * GiB,
    free: int = 20 * GiB,
    integrated: bool = False,
) -> None:
    """Make torch report one CUDA device with these properties."""
    props = SimpleNamespace(
        name=name, total_memory=total, is_integrated=integrated, major=8, minor=9
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free, total))
    monkeypatch.setattr(torch.version, "cuda", "12.4")


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    assert choose_accelerator("auto") == "cpu"
    assert choose_accelerator("cpu") == "cpu"
    assert describe_accelerator("auto") == CPU


def test_cuda_without_cuda_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    with pytest.raises(ConfigError, match=r"^--accelerator cuda: no CUDA device .*auto or cpu$"):
        choose_accelerator("cuda")


def test_unknown_choice_is_refused() -> None:
    with pytest.raises(ConfigError, match="'tpu' is not one of auto, cpu, cuda"):
        choose_accelerator("tpu")


def test_auto_and_cuda_take_a_gpu_cpu_never(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch)
    assert choose_accelerator("auto") == "cuda"
    assert choose_accelerator("cuda") == "cuda"
    assert choose_accelerator("cpu") == "cpu"
    assert describe_accelerator("cpu") == CPU


def test_discrete_gpu_description(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_gpu(monkeypatch)
    info = describe_accelerator("auto", root=tmp_path)
    assert (info.kind, info.name) == ("cuda", "NVIDIA GeForce RTX 4090")
    assert info.total_memory == 24 * GiB
    assert not info.shared_memory
    assert (info.capability, info.cuda_version) == ("8.9", "12.4")
    assert info.device == torch.device("cuda", 0)
    assert info.label == "cuda_NVIDIA_GeForce_RTX_4090"


def test_jetson_is_integrated_by_flag_or_release_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_gpu(monkeypatch, name="Orin", total=7 * GiB, integrated=True)
    assert describe_accelerator("auto", root=tmp_path).shared_memory
    _fake_gpu(monkeypatch, name="Orin", total=7 * GiB, integrated=False)
    assert not describe_accelerator("auto", root=tmp_path).shared_memory
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 3.0\n")
    assert describe_accelerator("auto", root=tmp_path).shared_memory


def test_budget_of_a_discrete_gpu_is_its_free_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_gpu(monkeypatch, total=24 * GiB, free=21 * GiB)
    info = describe_accelerator("auto", root=tmp_path)
    assert accelerator_budget(info, host_budget=3 * GiB) == 21 * GiB
    assert accelerator_budget(info, host_budget=3 * GiB, configured=5 * GiB) == 5 * GiB


def test_budget_of_an_integrated_gpu_is_the_hosts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_gpu(monkeypatch, name="Orin", total=7 * GiB, free=6 * GiB, integrated=True)
    info = describe_accelerator("auto", root=tmp_path)
    assert accelerator_budget(info, host_budget=3 * GiB) == 3 * GiB
    assert accelerator_budget(info, host_budget=3 * GiB, configured=2 * GiB) == 2 * GiB


def test_budget_of_a_cpu_is_the_hosts() -> None:
    assert accelerator_budget(CPU, host_budget=3 * GiB) == 3 * GiB
    assert CPU.label == ""


def test_settings_take_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().accelerator == "auto"
    assert WorkerSettings(accelerator="cpu").accelerator == "cpu"
    monkeypatch.setenv("ASTEROID_ACCELERATOR", "cuda")
    assert ProfilerSettings().accelerator == "cuda"
    with pytest.raises(ValueError, match="accelerator"):
        WorkerSettings(accelerator="gpu")  # type: ignore[arg-type]


def _root(tmp_path: Path) -> Path:
    """A fake root: 16 GB of RAM, no cgroup limits."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    (tmp_path / "proc/cpuinfo").write_text("model name\t: Fake CPU\n")
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    return tmp_path


def test_fingerprint_names_a_discrete_gpu_and_its_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = _root(tmp_path)
    cpu = device_fingerprint(4, 0, root, CPU)
    assert cpu == device_fingerprint(4, 0, root)  # a CPU's fingerprint is what it always was
    assert "cuda" not in cpu and "-16.0g-" in cpu
    _fake_gpu(monkeypatch, name="NVIDIA H100 80GB HBM3", total=80 * GiB, free=79 * GiB)
    gpu = device_fingerprint(4, 0, root, describe_accelerator("cuda", root))
    assert "-4t-cuda_NVIDIA_H100_80GB_HBM3-80.0g-" in gpu  # the card's memory, not the host's
    assert gpu != cpu
    assert re.fullmatch(FINGERPRINT_PATTERN, gpu)
    f = facts(gpu)
    assert f is not None and (f.threads, f.memory_bytes) == (4, 80 * GiB)
    # free memory moves; the fingerprint does not
    _fake_gpu(monkeypatch, name="NVIDIA H100 80GB HBM3", total=80 * GiB, free=3 * GiB)
    assert device_fingerprint(4, 0, root, describe_accelerator("cuda", root)) == gpu
    _fake_gpu(monkeypatch, name="NVIDIA A100-SXM4-80GB", total=80 * GiB, free=79 * GiB)
    assert device_fingerprint(4, 0, root, describe_accelerator("cuda", root)) != gpu


def test_fingerprint_of_a_jetson_keeps_the_hosts_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = _root(tmp_path)
    _fake_gpu(monkeypatch, name="Orin", total=15 * GiB, integrated=True)
    fp = device_fingerprint(6, 0, root, describe_accelerator("auto", root))
    assert "-6t-cuda_Orin-16.0g-" in fp
    configured = device_fingerprint(6, 2 * GiB, root, describe_accelerator("auto", root))
    assert "-6t-cuda_Orin-2.0g-" in configured  # a configured budget wins, as on a CPU
    f = facts(fp)
    assert f is not None and f.memory_bytes == 16 * GiB


def test_full_precision_turns_tf32_off_on_a_gpu_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = True
        full_precision(CPU)
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        _fake_gpu(monkeypatch)
        full_precision(describe_accelerator("cuda", tmp_path))
        assert not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
