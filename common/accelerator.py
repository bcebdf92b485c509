"""Which processor a worker or profiler computes on, and how much memory that gives it.

One module decides so that the worker, the profiler and `asteroid doctor` agree:
``auto`` takes CUDA whenever torch sees a GPU (a Jetson's compute is its GPU),
``cpu`` never does, and ``cuda`` without a GPU is an error rather than a silent
CPU run. A GPU's memory is either its own (a discrete card: the budget is what
is free on the card) or the host's (a Jetson or another integrated GPU: the
budget is the host's, as for a CPU device, because both draw on the same RAM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from common.errors import ConfigError
from common.settings import AcceleratorChoice

__all__ = [
    "ACCELERATORS",
    "AcceleratorChoice",
    "AcceleratorInfo",
    "accelerator_budget",
    "choose_accelerator",
    "describe_accelerator",
    "full_precision",
    "synchronize",
]

ACCELERATORS: tuple[str, ...] = get_args(AcceleratorChoice)
"""The values `--accelerator` takes."""

_TEGRA_RELEASE = Path("etc/nv_tegra_release")
"""Present on every Jetson (L4T): its GPU shares the host's memory."""


@dataclass(frozen=True)
class AcceleratorInfo:
    """The processor a process computes on, as the planner and a person need to see it."""

    kind: Literal["cpu", "cuda"]
    name: str
    """The GPU's name (``NVIDIA H100 80GB HBM3``, ``Orin``), or ``cpu``."""
    index: int
    """The CUDA device index (0 on a CPU)."""
    total_memory: int
    """Bytes of the GPU's memory (0 on a CPU: the host's memory is `common.device`'s)."""
    shared_memory: bool
    """True when this memory is the host's: a CPU, a Jetson, an integrated GPU."""
    capability: str = ""
    """CUDA compute capability, like ``9.0`` (empty on a CPU)."""
    cuda_version: str = ""
    """The CUDA version torch was built with (empty for a CPU build)."""

    @property
    def device(self) -> torch.device:
        """The torch device a stage's weights and computation live on."""
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    @property
    def label(self) -> str:
        """A short fingerprint-safe name (empty on a CPU, so CPU fingerprints stay as they were).

        Letters, digits and underscores only, so it sits between a fingerprint's
        dashes: ``cuda_NVIDIA_H100_80GB_HBM3``.
        """
        if self.kind == "cpu":
            return ""
        slug = re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_")[:40]
        return f"cuda_{slug}" if slug else "cuda"


CPU = AcceleratorInfo(kind="cpu", name="cpu", index=0, total_memory=0, shared_memory=True)
"""The host's processor: what every process computes on without a GPU."""


def choose_accelerator(choice: str) -> Literal["cpu", "cuda"]:
    """The kind `choice` (``auto``, ``cpu`` or ``cuda``) resolves to on this machine.

    Raises:
        ConfigError: `choice` is not one of them, or is ``cuda`` where torch sees no GPU.

    """
    if choice not in ACCELERATORS:
        raise ConfigError(f"accelerator {choice!r} is not one of {', '.join(ACCELERATORS)}")
    if choice == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        build = torch.version.cuda
        why = "this torch is a CPU build" if build is None else f"torch for CUDA {build} sees none"
        raise ConfigError(f"--accelerator cuda: no CUDA device ({why}); use auto or cpu")
    return "cuda" if available else "cpu"


def _integrated(props: object, root: Path) -> bool:
    """Whether the GPU draws on the host's RAM (CUDA's own flag, or a Jetson's release file)."""
    return bool(getattr(props, "is_integrated", False)) or (root / _TEGRA_RELEASE).exists()


def describe_accelerator(choice: str = "auto", root: Path = Path("/")) -> AcceleratorInfo:
    """What `choice` gives this process: kind, name, memory, whether memory is the host's.

    Uses the current CUDA device (``CUDA_VISIBLE_DEVICES`` picks among several).

    Raises:
        ConfigError: as `choose_accelerator`.

    """
    if choose_accelerator(choice) == "cpu":
        return CPU
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return AcceleratorInfo(
        kind="cuda",
        name=str(props.name),
        index=index,
        total_memory=int(props.total_memory),
        shared_memory=_integrated(props, root),
        capability=f"{props.major}.{props.minor}",
        cuda_version=str(torch.version.cuda or ""),
    )


def accelerator_budget(info: AcceleratorInfo, host_budget: int, configured: int = 0) -> int:
    """Bytes a stage may use on `info`: what the planner should plan this device with.

    `configured` (a person's ``--memory-budget``) wins; a CPU or a GPU that
    shares the host's memory gets `host_budget` (the cgroup- or RAM-derived
    budget of `common.device`); a discrete GPU gets what is free on the card now
    (this process's CUDA context already taken off).
    """
    if configured > 0:
        return configured
    if info.shared_memory:
        return host_budget
    free, _total = torch.cuda.mem_get_info(info.index)
    return int(free)


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op on a CPU), so a timer measures the work.

    CUDA kernels run asynchronously: without this a timed call measures only
    its launch.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_precision(info: AcceleratorInfo) -> None:
    """Make float32 on `info`'s GPU mean float32: no TensorFloat-32 in matmuls or convolutions.

    cuDNN convolutions use TF32 by default on Ampere and later (Jetson Orin
    included), a 10-bit mantissa that would put a GPU stage a thousand times
    further from the CPU's arithmetic than float32 round-off does; a job's
    stages must compute the same model wherever they run. No-op on a CPU.
    """
    if info.kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
