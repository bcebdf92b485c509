"""What each device should hold: its files (keys, settings) and its containers.

Pure: it takes the inventory, the key set's files, the Redis ACL template and
the local images' ids, and returns plain values, so the whole layout is
tested without a device. Every container carries a config hash over its
command, limits, image id and the bytes of every file it mounts, so a change
of any of them, and nothing else, makes a deploy replace that container.

Each service gets its own folder of keys (the set's public files, its own
secret key and its own Redis password) mounted at /keys, so no container
holds another's secret. Settings go in an env file without any password: the
images' entrypoint joins the URL and the password file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from common.curve import COORDINATOR, FOLDERS
from common.errors import ConfigError
from services.deploy.credentials import PASSWORD_DIR, acl_file, redis_passwords, redis_url
from services.deploy.inventory import Arch, Device, Inventory, Role

__all__ = [
    "LABEL",
    "RUNTIME_UID",
    "SERVICES",
    "SHIPPED",
    "ContainerSpec",
    "DesiredDevice",
    "FileSpec",
    "ImageKind",
    "bare_state",
    "container_name",
    "desired_state",
    "device_arch",
    "device_dir",
    "device_images",
    "device_repositories",
    "image_ref",
    "local_ref",
    "needed_images",
]

ImageKind = Literal["worker", "control", "redis"]
Service = Literal["redis", "coordinator", "planner", "worker", "profiler"]

SERVICES: dict[Role, tuple[Service, ...]] = {
    "control": ("redis", "coordinator", "planner"),
    "worker": ("worker", "profiler"),
}
"""The containers a role runs."""

START_ORDER: tuple[Service, ...] = ("redis", "coordinator", "planner", "worker", "profiler")
IMAGE_OF: dict[Service, ImageKind] = {
    "redis": "redis",
    "coordinator": "control",
    "planner": "control",
    "worker": "worker",
    "profiler": "worker",
}
COMMAND: dict[Service, tuple[str, ...]] = {
    "coordinator": ("asteroid-coordinator",),
    "planner": ("asteroid-planner",),
    "worker": ("asteroid-worker",),
    "profiler": ("asteroid-profiler", "--serve"),
}
SECRET_OF: dict[Service, tuple[str, str]] = {
    "coordinator": ("coordinator", COORDINATOR),
    "planner": ("service", "planner"),
    "profiler": ("service", "profiler"),
}
"""Which secret key of the set each service holds (a worker: its device's own)."""

LABEL = "asteroid"
"""Prefix of the labels on our containers (asteroid.cluster, asteroid.device, ...)."""
RUNTIME_UID = 10001
"""The user the worker and control images run as (deploy/images/Dockerfile): owns /keys."""
KEYS_IN_CONTAINER = "/keys"
REDIS_ETC = "/etc/asteroid"
SHIPPED = ".shipped"
"""File in a device's folder listing the images a deploy copied there ("ID REF" lines)."""


@dataclass(frozen=True)
class FileSpec:
    """A file of a device's folder: its bytes, permissions and owner (None: the ssh user)."""

    content: bytes
    mode: int = 0o600
    owner: int | None = None

    @property
    def digest(self) -> str:
        """SHA-256 of the content, as `sha256sum` prints it on the device."""
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True)
class ContainerSpec:
    """One container: what `docker run` gets, and the hash that tells if it changed."""

    name: str
    service: Service
    image: str
    image_id: str
    args: tuple[str, ...]
    env_file: str | None
    mounts: tuple[tuple[str, str], ...]
    """(path on the device, path in the container), all read-only."""
    volumes: tuple[tuple[str, str], ...]
    """(named volume, path in the container), read-write."""
    cpus: float
    memory: int | None
    labels: tuple[tuple[str, str], ...]
    health: str
    """Healthcheck command (shell), replacing the image's: ports here come from the inventory."""
    entrypoint: str | None = None
    user: str | None = None
    config: str = ""
    """Hash over everything above and the bytes of the files mounted."""

    def run_argv(self) -> list[str]:
        """`docker run` for this container: detached, host network, restarted unless stopped."""
        argv = ["docker", "run", "--detach", "--name", self.name, "--restart", "unless-stopped"]
        argv += ["--network", "host", "--cpus", f"{self.cpus:g}"]
        if self.memory is not None:
            argv += ["--memory", str(self.memory), "--memory-swap", str(self.memory)]
        for key, value in (*self.labels, (f"{LABEL}.config", self.config)):
            argv += ["--label", f"{key}={value}"]
        argv += ["--health-cmd", self.health, "--health-interval", "5s"]
        argv += ["--health-timeout", "5s", "--health-start-period", "60s"]
        if self.env_file is not None:
            argv += ["--env-file", self.env_file]
        for src, dst in self.mounts:
            argv += ["--volume", f"{src}:{dst}:ro"]
        for vol, dst in self.volumes:
            argv += ["--volume", f"{vol}:{dst}"]
        if self.user is not None:
            argv += ["--user", self.user]
        if self.entrypoint is not None:
            argv += ["--entrypoint", self.entrypoint]
        return [*argv, self.image, *self.args]


@dataclass(frozen=True)
class DesiredDevice:
    """Everything one device should hold after a deploy."""

    device: Device
    directory: str
    files: dict[str, FileSpec] = field(default_factory=dict)
    containers: tuple[ContainerSpec, ...] = ()


def device_arch(dev: Device) -> Arch:
    """The architecture of `dev`'s images, once known (the deploy asks each device first)."""
    if dev.arch is None:
        raise ConfigError(
            f"device {dev.name}: its architecture is not known (the deploy asks the device "
            "before it picks images)"
        )
    return dev.arch


def local_ref(kind: ImageKind, version: str, arch: Arch) -> str:
    """An image as `make images` tags it here (deploy/images/build.sh: arm64 has a suffix)."""
    return f"asteroid-edge/{kind}:{version}" + ("" if arch == "amd64" else f"-{arch}")


def image_ref(inv: Inventory, kind: ImageKind, version: str, arch: Arch) -> str:
    """The reference devices run an image by (the registry's copy when one is set)."""
    ref = local_ref(kind, version, arch)
    return f"{inv.registry}/{ref}" if inv.registry else ref


def device_images(inv: Inventory, dev: Device, version: str) -> set[str]:
    """References of the images `dev` runs, as the device knows them."""
    arch = device_arch(dev)
    return {image_ref(inv, IMAGE_OF[s], version, arch) for r in dev.roles for s in SERVICES[r]}


def device_repositories(inv: Inventory, dev: Device) -> set[str]:
    """Repositories (references without a tag) of the images `dev` may hold, of any arch."""
    return {
        image_ref(inv, IMAGE_OF[s], "0", "amd64").rsplit(":", 1)[0]
        for r in dev.roles
        for s in SERVICES[r]
    }


def bare_state(inv: Inventory) -> list[DesiredDevice]:
    """Every device with its folder but no files or containers, the control device first.

    What `undeploy` needs: it removes what it finds, so it needs neither the
    images nor the key set.
    """
    devices = sorted(inv.devices, key=lambda d: "control" not in d.roles)
    return [DesiredDevice(d, device_dir(inv, d.name)) for d in devices]


def needed_images(inv: Inventory, version: str) -> set[str]:
    """Local references of every image some device of the inventory runs."""
    return {
        local_ref(IMAGE_OF[s], version, device_arch(d))
        for d in inv.devices
        for r in d.roles
        for s in SERVICES[r]
    }


def container_name(inv: Inventory, device: str, service: str) -> str:
    """asteroid-<cluster>-<device>-<service>."""
    return f"asteroid-{inv.cluster}-{device}-{service}"


def device_dir(inv: Inventory, device: str) -> str:
    """The device's folder for this cluster (named by device too: devices may share a disk)."""
    return f"{inv.remote_dir}/{inv.cluster}/{device}"


def _bind_host(inv: Inventory) -> str:
    """Where the control services listen: the coordinator's address if it is one, else all."""
    host = inv.coordinator_host
    return host if all(part.isdigit() for part in host.split(".")) else "0.0.0.0"


def _local(host: str) -> str:
    return "127.0.0.1" if host == "0.0.0.0" else host


def _env(values: Mapping[str, str]) -> bytes:
    for k, v in values.items():
        if "\n" in v or "\r" in v:
            raise ConfigError(f"setting {k} holds a line break")
    return "".join(f"{k}={v}\n" for k, v in values.items()).encode()


def _redis_user(service: Service) -> str:
    return service  # each service is the Redis ACL user of the same name


def _service_files(
    inv: Inventory, dev: Device, service: Service, keys: Mapping[str, bytes], password: str
) -> dict[str, FileSpec]:
    """The service's env file and its key folder: public files, own secret, own password."""
    role, name = SECRET_OF.get(service, ("worker", dev.name))
    secret = f"{FOLDERS[role]}/{name}.key_secret"
    if secret not in keys:
        flag = "" if role == "coordinator" else f" --{role} {name}"
        raise ConfigError(
            f"device {dev.name}: the key set has no {secret} for its {service} "
            f"(add it with `asteroid keys init DIR{flag}`)"
        )
    user = _redis_user(service)
    folder = f"keys/{service}"
    out = {
        f"{folder}/{path}": FileSpec(data, 0o644, RUNTIME_UID)
        for path, data in keys.items()
        if path.endswith(".key")
    }
    out[f"{folder}/{secret}"] = FileSpec(keys[secret], 0o600, RUNTIME_UID)
    out[f"{folder}/{PASSWORD_DIR}/{user}.password"] = FileSpec(
        password.encode(), 0o600, RUNTIME_UID
    )
    env = {
        "ASTEROID_CLUSTER": inv.cluster,
        "ASTEROID_COORDINATOR": inv.coordinator,
        "ASTEROID_REDIS_URL": redis_url(inv, user),
        "ASTEROID_REDIS_PASSWORD_FILE": f"{KEYS_IN_CONTAINER}/{PASSWORD_DIR}/{user}.password",
        "ASTEROID_KEYS": KEYS_IN_CONTAINER,
        "ASTEROID_LOG_FORMAT": "json",
    }
    if service == "coordinator":
        env["ASTEROID_BIND"] = f"tcp://{_bind_host(inv)}:{inv.coordinator_port}"
    if service == "worker":
        env["ASTEROID_DEVICE"] = dev.name
        env["ASTEROID_DATA_PORT"] = str(dev.data_port)
        env["ASTEROID_LINK_PORT"] = str(dev.link_port)
        if dev.threads:
            env["ASTEROID_THREADS"] = str(dev.threads)
        if dev.advertise_host:
            env["ASTEROID_ADVERTISE_HOST"] = dev.advertise_host
    out[f"env/{service}.env"] = FileSpec(_env(env), 0o600)
    return out


def _health(inv: Inventory, dev: Device, service: Service) -> str:
    if service == "redis":
        password = f"$(cat {REDIS_ETC}/operator.password)"
        return (
            f"redis-cli -h {_local(_bind_host(inv))} -p {inv.redis_port} --user operator "
            f'--pass "{password}" --no-auth-warning ping | grep -qx PONG'
        )
    if service == "worker":
        return f"asteroid-probe 127.0.0.1:{dev.data_port}"
    # a coordinator listens, a planner or profiler is of use while it reaches the coordinator
    return f"asteroid-probe {_local(_bind_host(inv))}:{inv.coordinator_port}"


def _container(
    inv: Inventory,
    dev: Device,
    service: Service,
    directory: str,
    files: Mapping[str, FileSpec],
    images: Mapping[str, str],
    version: str,
) -> ContainerSpec:
    kind = IMAGE_OF[service]
    arch = device_arch(dev)
    local = local_ref(kind, version, arch)
    if local not in images:
        raise ConfigError(f"device {dev.name}: no image {local} here (build it: make images)")
    name = container_name(inv, dev.name, service)
    if service == "redis":
        used = ["redis/users.acl", "redis/operator.password"]
        mounts = tuple((f"{directory}/{p}", f"{REDIS_ETC}/{p.split('/')[1]}") for p in used)
        args: tuple[str, ...] = ("/etc/redis/asteroid.conf", "--aclfile", f"{REDIS_ETC}/users.acl")
        args += ("--port", str(inv.redis_port), "--bind", _bind_host(inv))
        args += ("--protected-mode", "no", "--daemonize", "no", "--logfile", "")
        volumes: tuple[tuple[str, str], ...] = ((f"{name}-data", "/var/lib/redis"),)
        env_file, entrypoint, user = None, "redis-server", "redis"
    else:
        used = [p for p in files if p.startswith(f"keys/{service}/")] + [f"env/{service}.env"]
        mounts = ((f"{directory}/keys/{service}", KEYS_IN_CONTAINER),)
        args, volumes = COMMAND[service], ()
        env_file, entrypoint, user = f"{directory}/env/{service}.env", None, None
    spec = ContainerSpec(
        name=name,
        service=service,
        image=image_ref(inv, kind, version, arch),
        image_id=images[local],
        args=args,
        env_file=env_file,
        mounts=mounts,
        volumes=volumes,
        cpus=dev.cpus,
        memory=int(dev.memory) if service in ("worker", "profiler") else None,
        labels=(
            (f"{LABEL}.cluster", inv.cluster),
            (f"{LABEL}.device", dev.name),
            (f"{LABEL}.service", service),
            (f"{LABEL}.version", version),
        ),
        health=_health(inv, dev, service),
        entrypoint=entrypoint,
        user=user,
    )
    digests = {p: files[p].digest for p in sorted(used)}
    blob = json.dumps([spec.run_argv(), spec.image_id, digests], sort_keys=True)
    return replace(spec, config=hashlib.sha256(blob.encode()).hexdigest()[:16])


def desired_state(
    inv: Inventory,
    keys: Mapping[str, bytes],
    acl_template: str,
    images: Mapping[str, str],
    version: str,
) -> list[DesiredDevice]:
    """Every device's files and containers, the control device first.

    Args:
        inv: The inventory.
        keys: The key set's files, by path relative to its directory.
        acl_template: deploy/redis-acl.conf, whose placeholders get the passwords' hashes.
        images: Image id by local reference (`needed_images`), as this machine's engine has it.
        version: The release the images are tagged with.

    """
    passwords = redis_passwords(inv, keys)
    out = []
    for dev in sorted(inv.devices, key=lambda d: "control" not in d.roles):
        directory = device_dir(inv, dev.name)
        services = [s for s in START_ORDER if any(s in SERVICES[r] for r in dev.roles)]
        files: dict[str, FileSpec] = {}
        for service in services:
            if service == "redis":
                files["redis/users.acl"] = FileSpec(acl_file(acl_template, passwords), 0o644)
                # read by the healthcheck, as Redis's user: the read-only operator's password
                operator = passwords["operator"].encode()
                files["redis/operator.password"] = FileSpec(operator, 0o644)
            else:
                password = passwords[_redis_user(service)]
                files.update(_service_files(inv, dev, service, keys, password))
        containers = tuple(
            _container(inv, dev, s, directory, files, images, version) for s in services
        )
        out.append(DesiredDevice(dev, directory, files, containers))
    return out
