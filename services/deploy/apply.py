"""The effectful shell of a deploy: read the key set, probe devices, run the actions.

Everything that decides lives in `machine`, `desired` and `reconcile`; this
module only gathers their inputs (the key set, the local images' ids, each
device's architecture and report) and carries out their actions over ssh, one
bounded command each.
"""

from __future__ import annotations

import io
import shlex
import subprocess
import tarfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common.curve import FOLDERS
from common.errors import ConfigError
from services.deploy.credentials import PASSWORD_DIR, redis_passwords, redis_url
from services.deploy.desired import (
    SHIPPED,
    DesiredDevice,
    FileSpec,
    bare_state,
    desired_state,
    device_repositories,
    needed_images,
)
from services.deploy.inventory import Arch, Device, Inventory
from services.deploy.machine import MACHINE_SCRIPT, Machine, image_arch, parse_machine
from services.deploy.observe import DeviceReport, parse_report, probe_script
from services.deploy.reconcile import Action, ServiceStatus, plan_down, plan_up, status_rows
from services.deploy.ssh import Ssh, SshError

__all__ = ["Deployment", "local_image_ids", "operator_env", "read_key_set"]

MAX_KEY_FILES = 4096
MAX_KEY_BYTES = 64 << 10
SHIP_TIMEOUT_S = 1800.0
"""Longest copy of one image to one device (a torch image over a slow link)."""
STEP_TIMEOUT_S = 120.0
"""Longest any other single command on a device may take."""

Echo = Callable[[str], None]


def read_key_set(root: Path) -> dict[str, bytes]:
    """The key set's files by path relative to `root`, bounded.

    CURVE pairs of every role, and the Redis users' passwords
    (``redis/USER.password``) where the set holds them.
    """
    if not root.is_dir():
        raise ConfigError(f"key set {root} is not a directory (make it with `asteroid keys init`)")
    out: dict[str, bytes] = {}
    for folder in FOLDERS.values():
        for path in sorted((root / folder).glob("*.key*")):
            if path.suffix not in (".key", ".key_secret") or not path.is_file():
                continue
            if len(out) >= MAX_KEY_FILES:
                raise ConfigError(f"key set {root} holds more than {MAX_KEY_FILES} files")
            if path.stat().st_size > MAX_KEY_BYTES:
                raise ConfigError(f"key file {path} is larger than {MAX_KEY_BYTES} bytes")
            out[f"{folder}/{path.name}"] = path.read_bytes()
    for path in sorted((root / PASSWORD_DIR).glob("*.password")):
        if path.is_file() and path.stat().st_size <= MAX_KEY_BYTES:
            out[f"{PASSWORD_DIR}/{path.name}"] = path.read_bytes()
    return out


def local_image_ids(refs: set[str]) -> dict[str, str]:
    """Id of each image in this machine's engine; ConfigError naming a missing one."""
    ids: dict[str, str] = {}
    for ref in sorted(refs):
        try:
            out = subprocess.run(
                ["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"cannot ask the local docker engine about {ref}: {exc}") from exc
        if out.returncode != 0 or not out.stdout.startswith("sha256:"):
            raise ConfigError(
                f"image {ref} is not in this machine's engine (build it: make images)"
            )
        ids[ref] = out.stdout.strip()
    return ids


def operator_env(inv: Inventory, keys: Mapping[str, bytes], keys_dir: Path) -> dict[str, str]:
    """The ASTEROID_* settings with which this machine's `asteroid` CLI uses the cluster."""
    password = redis_passwords(inv, keys)["operator"]
    return {
        "ASTEROID_CLUSTER": inv.cluster,
        "ASTEROID_COORDINATOR": inv.coordinator,
        "ASTEROID_REDIS_URL": redis_url(inv, "operator", password),
        "ASTEROID_KEYS": str(keys_dir),
    }


def file_archive(files: Mapping[str, FileSpec]) -> bytes:
    """A tar of `files` (and their folders) with each one's mode and owner."""
    buf = io.BytesIO()
    dirs: dict[str, int | None] = {}
    for path, spec in sorted(files.items()):
        parts = path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            # top-level folders stay the ssh user's; below, a folder is its files' owner's
            dirs.setdefault("/".join(parts[:depth]), spec.owner if depth > 1 else None)
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, owner in sorted(dirs.items()):
            info = _info(name, tarfile.DIRTYPE, 0o700, owner)
            tar.addfile(info)
        for name, spec in sorted(files.items()):
            info = _info(name, tarfile.REGTYPE, spec.mode, spec.owner)
            info.size = len(spec.content)
            tar.addfile(info, io.BytesIO(spec.content))
    return buf.getvalue()


def _info(name: str, kind: bytes, mode: int, owner: int | None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, mode, 0
    info.uid = info.gid = owner or 0
    info.uname = info.gname = ""  # numeric owners: the device's names may differ
    return info


@dataclass
class Deployment:
    """One inventory with its key set and image version, deployed over ssh."""

    inv: Inventory
    keys_dir: Path
    version: str
    acl_template: str
    echo: Echo = field(default=lambda _line: None)
    save: Callable[[str], list[str]] = field(default=lambda ref: ["docker", "save", ref])
    """The local command writing image `ref` as a tar stream (an image archive may stand in)."""
    _want: list[DesiredDevice] | None = None
    _arches: dict[str, Arch] | None = None

    def machine(self, dev: Device) -> Machine:
        """What `dev` says its processor and Docker engine are (one ssh command)."""
        return parse_machine(dev.name, Ssh.of(self.inv, dev).sh(MACHINE_SCRIPT))

    def arches(self) -> dict[str, Arch]:
        """Each device's image architecture, asked of the devices once (in parallel) and kept.

        So one inventory holds amd64 and arm64 devices without anyone naming
        which is which, and a deploy asks each device once however many steps
        need the answer.
        """
        if self._arches is None:
            devices = list(self.inv.devices)
            with ThreadPoolExecutor(max_workers=min(8, len(devices))) as pool:
                machines = list(pool.map(self.machine, devices))
            self._arches = {
                d.name: image_arch(d, m) for d, m in zip(devices, machines, strict=True)
            }
        return self._arches

    def resolved(self) -> Inventory:
        """The inventory with every device's architecture as the device reported it."""
        return self.inv.with_arches(self.arches())

    def desired(self, images: Mapping[str, str] | None = None) -> list[DesiredDevice]:
        """Every device's desired state (architectures and local image ids are found once)."""
        if self._want is None:
            ids = images if images is not None else local_image_ids(self.needed())
            self._want = desired_state(
                self.resolved(), read_key_set(self.keys_dir), self.acl_template, ids, self.version
            )
        return self._want

    def needed(self) -> set[str]:
        """Local references of the images this inventory runs, each device's architecture's."""
        return needed_images(self.resolved(), self.version)

    def _ssh(self, want: DesiredDevice) -> Ssh:
        return Ssh.of(self.inv, want.device)

    def probe(self, want: DesiredDevice) -> DeviceReport:
        """What the device has now (one ssh command)."""
        repos = sorted(
            {c.image.rsplit(":", 1)[0] for c in want.containers}
            | device_repositories(self.inv, want.device)
        )
        script = probe_script(self.inv.cluster, want.device.name, want.directory, repos)
        return parse_report(want.device.name, self._ssh(want).sh(script))

    def probe_all(self, wants: list[DesiredDevice]) -> list[DeviceReport]:
        """Reports of every device, asked in parallel."""
        with ThreadPoolExecutor(max_workers=min(8, len(wants))) as pool:
            return list(pool.map(self.probe, wants))

    def up(self) -> list[Action]:
        """Bring every device to its desired state; the actions taken (none when current)."""
        wants = self.desired()
        done: list[Action] = []
        for want, have in zip(wants, self.probe_all(wants), strict=True):
            actions = plan_up(want, have)
            writes = [a.target for a in actions if a.kind == "write-file"]
            for action in actions:
                self.echo(str(action))
                if action.kind != "write-file":
                    self.apply(want, action)
                elif action.target == writes[-1]:  # the device's files go in one transfer
                    self._write(self._ssh(want), want, writes)
                done.append(action)
        return done

    def down(self) -> list[Action]:
        """Remove our containers, files and shipped images from every device (workers first)."""
        wants = list(reversed(bare_state(self.inv)))
        done: list[Action] = []
        for want, have in zip(wants, self.probe_all(wants), strict=True):
            for action in plan_down(want, have):
                self.echo(str(action))
                self.apply(want, action)
                done.append(action)
        return done

    def status(self) -> list[ServiceStatus]:
        """Per device and service: state, health, version."""
        wants = self.desired()
        reports = self.probe_all(wants)
        return [row for w, r in zip(wants, reports, strict=True) for row in status_rows(w, r)]

    # --- one action -------------------------------------------------------------

    def apply(self, want: DesiredDevice, action: Action) -> None:
        """Carry out one action on its device."""
        ssh = self._ssh(want)
        kind, target = action.kind, action.target
        if kind == "ship-image":
            self._ship(ssh, want, action)
        elif kind == "write-file":
            self._write(ssh, want, [target])
        elif kind == "remove-file":
            ssh.run(["rm", "-f", "--", f"{want.directory}/{target}"], timeout_s=STEP_TIMEOUT_S)
        elif kind in ("remove-container", "start-container", "remove-volume"):
            verb = {
                "remove-container": ["docker", "rm", "--force"],
                "start-container": ["docker", "start"],
                "remove-volume": ["docker", "volume", "rm", "--force"],
            }[kind]
            ssh.run([*verb, target], timeout_s=STEP_TIMEOUT_S)
        elif kind == "run-container":
            if action.container is None:
                raise ConfigError(f"{action}: no container spec")
            ssh.run(action.container.run_argv(), timeout_s=STEP_TIMEOUT_S)
        elif kind == "remove-image":
            out = ssh.run(["docker", "rmi", target], timeout_s=STEP_TIMEOUT_S, check=False)
            if out.returncode != 0:
                self.echo(f"{want.device.name}: kept image {target} (in use)")
        elif kind == "remove-dir":
            parent = want.directory.rsplit("/", 1)[0]
            ssh.sh('rm -rf -- "$1" && { rmdir -- "$2" 2>/dev/null || true; }', target, parent)

    def _write(self, ssh: Ssh, want: DesiredDevice, paths: list[str]) -> None:
        """Write files of the device's folder in one ssh command (a tar stream).

        Each file and folder carries its mode and owner: a file a container
        reads as the images' user is owned by that user, with its folders.
        """
        ssh.run(
            [
                "sh",
                "-c",
                'umask 077; mkdir -p "$1" && tar -x -p -C "$1" -f -',
                "sh",
                want.directory,
            ],
            timeout_s=STEP_TIMEOUT_S,
            data=file_archive({p: want.files[p] for p in paths}),
        )

    def _ship(self, ssh: Ssh, want: DesiredDevice, action: Action) -> None:
        """Copy an image to the device (save | ssh load, or push and pull), and record it."""
        ref = action.target
        local = ref.removeprefix(f"{self.inv.registry}/") if self.inv.registry else ref
        if self.inv.registry:
            for cmd in (["docker", "tag", local, ref], ["docker", "push", ref]):
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=SHIP_TIMEOUT_S)
                if out.returncode != 0:
                    raise SshError(f"`{shlex.join(cmd)}` failed: {out.stderr.strip()[-300:]}")
            ssh.run(["docker", "pull", ref], timeout_s=SHIP_TIMEOUT_S)
        else:
            ssh.pipe_from(self.save(local), ["docker", "load"], SHIP_TIMEOUT_S)
        got = ssh.run(
            ["docker", "image", "inspect", "--format", "{{.Id}}", ref], timeout_s=STEP_TIMEOUT_S
        )
        if got.stdout.decode().strip() != action.image_id:
            raise SshError(
                f"device {want.device.name}: {ref} has id {got.stdout.decode().strip()[:80]} "
                f"after shipping, expected {action.image_id}"
            )
        ssh.sh(
            'mkdir -p "$1" && echo "$2 $3" >> "$1/$4"',
            want.directory,
            action.image_id,
            ref,
            SHIPPED,
        )
