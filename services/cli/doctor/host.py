"""What this device is: processor, cores, memory, accelerator, torch build, installed extras.

Read from the kernel (`common.device`: cgroup limits, affinity) and from torch,
which is imported here, inside the checks, never when the CLI starts: on a
Pi, importing torch takes seconds that `asteroid --help` must not pay.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.device import cgroup_memory_limit, cpu_quota, memory_budget, visible_cores
from common.extras import EXTRAS
from services.cli.doctor.report import Check

__all__ = ["NVIDIA_DRIVER", "TEGRA_RELEASE", "accelerator_check", "extras_check", "host_checks"]

TEGRA_RELEASE = Path("etc/nv_tegra_release")
"""Present on every Jetson (L4T): a GPU is there, whatever torch says."""
NVIDIA_DRIVER = Path("proc/driver/nvidia/version")
"""Present where NVIDIA's kernel driver is loaded: a discrete GPU is there."""
GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def machine_check() -> Check:
    """Architecture and OS: which image and wheels (amd64 or arm64) this device takes."""
    arch = platform.machine() or "unknown"
    py = platform.python_version()
    return Check(
        "machine",
        "ok",
        f"{arch}, {platform.system()} {platform.release()}, Python {py}",
        data={"arch": arch, "system": platform.system(), "python": py},
    )


def cores_check(root: Path = Path("/")) -> Check:
    """Cores this process may use: what the worker's default thread count comes from."""
    cores = visible_cores()
    quota = cpu_quota(root)
    limited = f" (cgroup quota {quota:g} cores)" if quota is not None else ""
    return Check("cores", "ok", f"{cores}{limited}", data={"cores": cores, "quota": quota})


def memory_check(root: Path = Path("/")) -> Check:
    """Memory: the machine's, the cgroup's limit, and what training could use now."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit(root)
    available = memory_budget(0, root)
    text = f"{_gib(total)} total, {_gib(available)} available"
    if limit is not None:
        text += f" (cgroup limit {_gib(limit)})"
    return Check(
        "memory",
        "ok",
        text,
        data={"total_bytes": total, "available_bytes": available, "cgroup_limit_bytes": limit},
    )


def _gpu_signs(root: Path) -> str:
    """What says a GPU is here even when torch sees none: a Jetson's release file, a driver."""
    if (root / TEGRA_RELEASE).exists():
        return "a Jetson"
    if (root / NVIDIA_DRIVER).exists():
        return "an NVIDIA driver"
    return ""


def accelerator_check(torch: Any, choice: str = "auto", root: Path = Path("/")) -> Check:
    """What the worker computes on with `--accelerator choice`; an idle GPU is a problem.

    A Jetson or a PC with an NVIDIA driver whose torch is a CPU wheel trains on
    its CPU: the usual cause is `pip install` replacing NVIDIA's build.
    """
    from common.accelerator import describe_accelerator
    from common.errors import ConfigError

    try:
        info = describe_accelerator(choice, root)
    except ConfigError as exc:  # --accelerator cuda where torch sees no GPU
        return Check(
            "accelerator",
            "problem",
            str(exc),
            "run the worker with --accelerator auto (ASTEROID_ACCELERATOR) or install a CUDA "
            "build of torch",
        )
    if info.kind == "cuda":
        where = "shared with the host" if info.shared_memory else "its own"
        return Check(
            "accelerator",
            "ok",
            f"CUDA {info.index}: {info.name}, {_gib(info.total_memory)} ({where}), capability "
            f"{info.capability}",
            data={
                "kind": "cuda",
                "name": info.name,
                "total_memory_bytes": info.total_memory,
                "shared_memory": info.shared_memory,
            },
        )
    signs = _gpu_signs(root)
    if not signs or choice == "cpu":
        why = "the CPU (--accelerator cpu)" if signs else "the CPU: no GPU here"
        return Check("accelerator", "ok", why, data={"kind": "cpu"})
    build = torch.version.cuda
    if build is None:
        why = f"this is {signs}, but torch {torch.__version__} is a CPU build"
        fix = (
            "install NVIDIA's torch wheel for this JetPack: https://docs.nvidia.com/"
            "deeplearning/frameworks/install-pytorch-jetson-platform/"
            if signs == "a Jetson"
            else "pip install --force-reinstall torch --index-url "
            "https://download.pytorch.org/whl/cu124"
        )
    else:
        why = f"this is {signs}, but torch (CUDA {build}) sees no GPU"
        fix = "nvidia-smi (is the driver loaded? is CUDA_VISIBLE_DEVICES empty?)"
    return Check("accelerator", "problem", why, fix, data={"kind": "cpu", "gpu_signs": signs})


def torch_check(torch: Any) -> Check:
    """Which torch: its version and whether it was built for CUDA or the CPU only."""
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    return Check(
        "torch",
        "ok",
        f"{torch.__version__} ({build} build), {torch.get_num_threads()} threads",
        data={"version": str(torch.__version__), "cuda": torch.version.cuda},
    )


def extras_check(find: Callable[[str], object] = importlib.util.find_spec) -> Check:
    """Which extras are installed: found by their modules, none of which is imported.

    A device needs none of them (the base install runs a worker): a missing one is a note.
    """
    have = sorted(e for e, mods in EXTRAS.items() if all(find(m) is not None for m in mods))
    missing = sorted(set(EXTRAS) - set(have))
    text = f"installed: {', '.join(have) or 'none'}; not installed: {', '.join(missing) or 'none'}"
    fix = f"only if you want them: pip install 'asteroid-edge[{','.join(missing)}]'"
    return Check(
        "extras",
        "note" if missing else "ok",
        text,
        fix if missing else "",
        data={"installed": have, "missing": missing},
    )


def host_checks(accelerator: str = "auto", root: Path = Path("/")) -> list[Check]:
    """Every check of this device itself; torch's failing to import is one of them."""
    checks = [machine_check(), cores_check(root), memory_check(root)]
    try:
        import torch
    except (
        ImportError,
        OSError,
    ) as exc:  # a broken or missing install: say so, go on with the rest
        checks.append(
            Check("torch", "problem", f"cannot import torch: {exc}", "pip install 'torch>=2.3'")
        )
    else:
        checks += [accelerator_check(torch, accelerator, root), torch_check(torch)]
    checks.append(extras_check())
    return checks
