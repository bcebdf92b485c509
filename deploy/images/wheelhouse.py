"""What a wheelhouse lacks for the image's interpreter: requirements no wheel in it meets.

`pip download` evaluates environment markers for the interpreter that runs it,
so resolving on a host with Python 3.11.7 leaves out redis-py's
``async-timeout; python_full_version < "3.11.3"``, which Debian bookworm's
python3 (3.11.2) needs: the offline install in the image then fails. This reads
every wheel's Requires-Dist, evaluates the markers for the image's interpreter
and machine, and prints each requirement no wheel in the folder satisfies, one
a line, for build.sh to download (it asks again until nothing is missing).
Usage: python wheelhouse.py DIR --python 3.11.2 --machine x86_64
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version


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
    """Requirements of the folder's wheels, for that interpreter, that no wheel meets."""
    env = target_environment(python, machine)
    have: dict[str, list[Version]] = {}
    wheels = sorted(folder.glob("*.whl"))
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        have.setdefault(canonicalize_name(name), []).append(version)
    out = set()
    for wheel in wheels:
        for req in requirements(wheel):
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            versions = have.get(canonicalize_name(req.name), [])
            if not any(req.specifier.contains(v, prereleases=True) for v in versions):
                out.add(f"{req.name}{req.specifier}")
    return sorted(out)


def main() -> None:
    """Print what is missing, one requirement a line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python", required=True, help="full version, e.g. 3.11.2")
    parser.add_argument("--machine", required=True, help="e.g. x86_64 or aarch64")
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a directory")
    for line in missing(args.folder, args.python, args.machine):
        sys.stdout.write(line + "\n")


if __name__ == "__main__":
    main()
