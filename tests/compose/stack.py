"""deploy/compose.yaml brought up under a project name of its own, and taken down again.

Every docker and docker-compose call is a real command with a timeout; the
secrets are made by `deploy/images/compose-keys.sh`, as a person would make
them. Whatever happens, `down` removes the project's containers, network and
volume, and `leftovers` lists what the engine still holds of it, so a test can
prove that nothing stayed behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common.ports import free_port
from common.version import VERSION

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
KEYS_SCRIPT = REPO / "deploy" / "images" / "compose-keys.sh"
IMAGES = ("redis", "control", "worker")
TAG = VERSION.replace("+", "-")
"""The tag `make images` gives this version's images."""
WORKERS = ("worker-1", "worker-2", "worker-3")
SERVICES = ("redis", "coordinator", "planner", *WORKERS, "profiler-1", "profiler-2", "profiler-3")
PROJECT_LABEL = "com.docker.compose.project"


def run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run `cmd`; its stdout, or AssertionError with the command and both outputs."""
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(cmd)} took over {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{output}")
    return done.stdout


def engine_missing() -> str | None:
    """Why the compose tests cannot run here (no engine, no docker-compose, no images)."""
    for cmd in (["docker", "info"], ["docker-compose", "version"]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{' '.join(cmd)}` cannot run: {exc}"
        if done.returncode != 0:
            return f"`{' '.join(cmd)}` fails: {done.stderr.strip()[-300:]}"
    for name in IMAGES:
        image = f"asteroid-edge/{name}:{TAG}"
        found = subprocess.run(
            ["docker", "image", "inspect", image], capture_output=True, timeout=30, check=False
        )
        if found.returncode != 0:
            return f"image {image} is missing (make images)"
    return None


def asteroid_command() -> str:
    """The `asteroid` CLI of the interpreter running the tests."""
    return str(Path(sys.executable).with_name("asteroid"))


@dataclass
class ComposeStack:
    """One compose project: its secrets, its published ports, its commands."""

    tmp: Path
    project: str = field(default_factory=lambda: f"aetest{uuid.uuid4().hex[:10]}")
    cluster: str = "compose"
    port: int = field(default_factory=free_port)
    redis_port: int = field(default_factory=free_port)

    @property
    def keys(self) -> Path:
        """The CURVE key set and the Redis passwords (the operator's secret included)."""
        return self.tmp / "keys"

    def env(self) -> dict[str, str]:
        """What docker-compose interpolates into deploy/compose.yaml."""
        return {
            **os.environ,
            "ASTEROID_KEYS": str(self.keys),
            "ASTEROID_UID": str(os.getuid()),
            "ASTEROID_GID": str(os.getgid()),
            "ASTEROID_CLUSTER": self.cluster,
            "ASTEROID_IMAGE_TAG": TAG,
            "ASTEROID_COMPOSE_PORT": str(self.port),
            "ASTEROID_COMPOSE_REDIS_PORT": str(self.redis_port),
        }

    def operator_env(self) -> dict[str, str]:
        """The host CLI's settings: the published coordinator, Redis as the operator."""
        return {
            **os.environ,
            "ASTEROID_KEYS": str(self.keys),
            "ASTEROID_COORDINATOR": f"tcp://127.0.0.1:{self.port}",
            "ASTEROID_REDIS_URL": self.redis_url("operator"),
            "ASTEROID_CLUSTER": self.cluster,
        }

    def redis_url(self, role: str) -> str:
        """The published Redis as the ACL user `role`."""
        password = (self.keys / "redis" / f"{role}.password").read_text().strip()
        return f"redis://{role}:{password}@127.0.0.1:{self.redis_port}/0"

    def compose(self, *args: str, timeout_s: float = 120.0) -> str:
        """`docker-compose -p PROJECT -f deploy/compose.yaml ARGS`; its stdout."""
        cmd = ["docker-compose", "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        return run(cmd, timeout_s, self.env())

    def make_keys(self) -> None:
        """The secrets directory, made by the script docs/deploy.md gives."""
        env = {**os.environ, "ASTEROID": asteroid_command()}
        run(["bash", str(KEYS_SCRIPT), str(self.keys), str(len(WORKERS))], 60, env)

    def container(self, service: str) -> str:
        """The id of `service`'s container."""
        ids = self.compose("ps", "-q", service, timeout_s=30).split()
        if len(ids) != 1:
            raise AssertionError(f"{service}: expected one container, found {ids}")
        return ids[0]

    def health(self) -> dict[str, str]:
        """Each service's container state: its health status, or its state if it has none."""
        ids = self.compose("ps", "-q", timeout_s=30).split()
        if not ids:
            return {}
        out = run(["docker", "inspect", *ids], 30)
        states = {}
        for info in json.loads(out):
            service = info["Config"]["Labels"].get("com.docker.compose.service", "?")
            state = info["State"]
            states[service] = state.get("Health", {}).get("Status") or state["Status"]
        return states

    def wait_healthy(self, timeout_s: float) -> None:
        """Until every service's healthcheck passes; AssertionError with the states if not."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.health()
            if set(states) == set(SERVICES) and all(s == "healthy" for s in states.values()):
                return
            time.sleep(2)
        raise AssertionError(
            f"not healthy within {timeout_s:.0f} s: {states}\n{self.logs(tail=20)}"
        )

    def logs(self, *services: str, tail: int = 60) -> str:
        """The last `tail` lines of the services' logs (all services by default)."""
        try:
            return self.compose("logs", "--no-color", f"--tail={tail}", *services, timeout_s=60)
        except AssertionError as exc:
            return f"(no logs: {exc})"

    def down(self) -> None:
        """Stop and remove the project's containers, network and volumes."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout_s=180)

    def leftovers(self) -> dict[str, list[str]]:
        """What the engine still holds of this project, by kind (empty lists: nothing)."""
        label = f"label={PROJECT_LABEL}={self.project}"
        by_label = {
            "containers": ["docker", "ps", "-a", "-q", "--filter", label],
            "networks": ["docker", "network", "ls", "-q", "--filter", label],
            "volumes": ["docker", "volume", "ls", "-q", "--filter", label],
        }
        found = {kind: run(cmd, 30).split() for kind, cmd in by_label.items()}
        # by name too, in case a label was never set
        names = {
            "networks": ["docker", "network", "ls", "--format", "{{.Name}}"],
            "volumes": ["docker", "volume", "ls", "--format", "{{.Name}}"],
        }
        for kind, cmd in names.items():
            found[kind] += [n for n in run(cmd, 30).split() if n.startswith(f"{self.project}_")]
        return found
