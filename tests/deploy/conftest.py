"""Fixtures of the deploy tests: a real ssh path to emulated devices, a real Docker engine.

They skip where the machine lacks root, network namespaces, sshd, the engine
or the images, except in CI (CI=true), where a missing piece is a broken
machine and fails the test instead of hiding it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.deploy import DEFAULT_TAG
from tests.deploy.sshdevices import SSHD, SshDevices


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true, so the deploy tests must run, but: {reason}")
    pytest.skip(reason)


def _ssh_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    for tool in (SSHD, "ssh", "ssh-keygen", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install openssh-server openssh-client)"
    probe = f"aedprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def engine_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    out = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    return None if out.returncode == 0 else "no Docker engine answers (docker info)"


def images_missing() -> list[str]:
    refs = [f"asteroid-edge/{k}:{DEFAULT_TAG}" for k in ("worker", "control", "redis")]
    return [
        r
        for r in refs
        if subprocess.run(["docker", "image", "inspect", r], capture_output=True).returncode
    ]


@pytest.fixture(scope="session")
def ssh_host() -> None:
    reason = _ssh_unavailable()
    if reason:
        skip_or_fail(reason)


@pytest.fixture(scope="session")
def engine(ssh_host: None) -> None:
    reason = engine_unavailable()
    if reason:
        skip_or_fail(reason)


@pytest.fixture(scope="session")
def images(engine: None) -> None:
    missing = images_missing()
    if missing:
        skip_or_fail(f"images {', '.join(missing)} are not built (make images)")


@pytest.fixture
def tag() -> str:
    return secrets.token_hex(3)


@pytest.fixture
def devices(
    request: pytest.FixtureRequest, ssh_host: None, tmp_path: Path, tag: str
) -> Iterator[SshDevices]:
    """Three devices (ctl, w1, w2) by default; a test names others with @pytest.mark.parametrize."""
    names = getattr(request, "param", ["ctl", "w1", "w2"])
    devs = SshDevices(names, tmp_path / "ssh", tag)
    with devs:
        yield devs
    assert devs.leftovers() == []
