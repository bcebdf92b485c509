"""Wrap a root file system tar into an image archive for `docker load`, naming its architecture.

`docker import --platform linux/arm64` is honoured only by newer engines (an
older one, like Debian bookworm's Docker 20.10, records the host's amd64 and
then refuses every build step on it: "does not match the specified
platform"). An archive in `docker save`'s format carries its own config,
architecture included, and every engine loads it the same: one layer (the
tar as mmdebstrap wrote it), the config (architecture, environment, command)
and the manifest naming the tag. Written to stdout as a stream.
Usage: python rootfs_image.py ROOTFS.tar --arch arm64 --tag REF [--env K=V ...] | docker load
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import IO

VARIANTS = {"arm64": "v8"}
"""The CPU variant docker records for an architecture (as its own images do)."""


def digest(path: Path) -> str:
    """SHA-256 of a file, read in blocks (a root file system is a few hundred MB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def image_config(arch: str, layer_digest: str, env: list[str], cmd: list[str]) -> bytes:
    """The image's config: architecture, run settings and its one layer's diff id."""
    config: dict[str, object] = {
        "architecture": arch,
        "os": "linux",
        "config": {"Env": env, "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
        "history": [{"created_by": "mmdebstrap (deploy/images/build.sh)"}],
    }
    if arch in VARIANTS:
        config["variant"] = VARIANTS[arch]
    return json.dumps(config, sort_keys=True).encode()


def write_archive(
    out: IO[bytes], rootfs: Path, arch: str, tag: str, env: list[str], cmd: list[str]
) -> str:
    """Write the `docker load` archive to `out`; the config's digest (the image id)."""
    layer = digest(rootfs)
    config = image_config(arch, layer, env, cmd)
    config_id = hashlib.sha256(config).hexdigest()
    manifest = [
        {"Config": f"{config_id}.json", "RepoTags": [tag], "Layers": [f"{layer}/layer.tar"]}
    ]
    with tarfile.open(fileobj=out, mode="w|") as tar:
        _add(tar, f"{config_id}.json", config)
        info = tar.gettarinfo(str(rootfs), arcname=f"{layer}/layer.tar")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        with rootfs.open("rb") as f:
            tar.addfile(info, f)
        _add(tar, "manifest.json", json.dumps(manifest).encode())
    return f"sha256:{config_id}"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def main() -> None:
    """Write the archive of the given root file system to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rootfs", type=Path)
    parser.add_argument("--arch", required=True, choices=["amd64", "arm64"])
    parser.add_argument("--tag", required=True)
    parser.add_argument("--env", action="append", default=[], help="K=V, repeatable")
    parser.add_argument("--cmd", default='["/bin/bash"]', help="the command, as a JSON list")
    args = parser.parse_args()
    if not args.rootfs.is_file():
        parser.error(f"{args.rootfs} is not a file")
    if any("=" not in e for e in args.env):
        parser.error("--env takes K=V")
    cmd = json.loads(args.cmd)
    if not isinstance(cmd, list) or not all(isinstance(c, str) for c in cmd):
        parser.error("--cmd must be a JSON list of strings")
    write_archive(sys.stdout.buffer, args.rootfs, args.arch, args.tag, args.env, cmd)


if __name__ == "__main__":
    main()
