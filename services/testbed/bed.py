"""A testbed: N emulated edge devices on this machine, with the services that train on them.

`Testbed.up` builds the network (`services.testbed.net`) and the cgroups
(`services.testbed.cgroups`), then starts the host side (an embedded Redis
on the bridge address, the coordinator, the planner) and, per device, a
worker and a profiler service inside the device: its network namespace, its
cgroup and its own host name (a UTS namespace), so the device is a machine of
its own to every service, profiles are measured under the device's quota and
memory limit, and the coordinator does not mistake devices for workers
crowding one host. Faults are methods: `kill`, `pause`/`resume`, `slow`,
`cut`/`heal`. `down` removes everything, also after errors and Ctrl-C
(context manager); a run that was SIGKILLed is cleaned up by
`cleanup_leftovers`, from the names alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from common.curve import FOLDERS, create_key_set
from common.embedded_redis import EmbeddedRedis
from common.entry_points import service_command
from common.errors import AsteroidError, ConfigError
from common.logging import get_logger
from common.procs import spawn, stop_all
from services.launcher import ServiceDied, service_env
from services.testbed import net
from services.testbed.cgroups import DeviceCgroup
from services.testbed.spec import TestbedSpec, cluster_spec
from services.testbed.survey import Found, cleanup_leftovers, find, remove

__all__ = ["ServiceDied", "Testbed", "cleanup_leftovers", "require_root"]

log = get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
"""Where `ip netns add` pins named namespaces."""


def require_root() -> None:
    """ConfigError unless this process may create namespaces, links and cgroups."""
    if os.geteuid() != 0:
        raise ConfigError(
            "the testbed needs root: it creates network namespaces, tc queues and cgroups "
            "(run it with sudo, or in a privileged container)"
        )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _enter_device(netns: str, procs_files: Sequence[Path], hostname: str) -> Callable[[], None]:
    """The child's first steps: die with us, join the cgroups, the namespace, a host name.

    Runs between fork and exec, so everything the command starts is inside the
    device from its first instruction; what allocates is done here, before
    the fork. The namespace is entered with setns(2) rather than `ip netns
    exec`, which would remount /sys and so hide /sys/fs/cgroup: the services
    read their quota and memory limit there.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    files = [str(f) for f in procs_files]
    ns_path = f"{NETNS_DIR}/{netns}"
    name = hostname.encode()

    def enter() -> None:  # pragma: no cover - runs in the child
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        pid = str(os.getpid()).encode()
        for f in files:
            fd = os.open(f, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        fd = os.open(ns_path, os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"cannot enter network namespace {netns}")
        finally:
            os.close(fd)
        if libc.unshare(_CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
            raise OSError(ctypes.get_errno(), "cannot give the device its own host name")

    return enter


class Testbed:
    """Emulated devices (namespace, shaped link, cgroup) and, optionally, the services on them."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self,
        spec: TestbedSpec,
        log_dir: Path,
        tag: str | None = None,
        cluster: str | None = None,
        threads: int = 1,
        heartbeat_s: float = 0.5,
        stop: threading.Event | None = None,
        redis_dir: Path | None = None,
        spare: Sequence[str] = (),
    ) -> None:
        """Describe the testbed; nothing is created before `up`.

        Args:
            spec: The devices.
            log_dir: Folder for each process's log and the planner's cluster file.
            tag: Short id in every name the testbed creates (default: random).
            cluster: Redis key prefix of the services (default: the spec's name).
            threads: Torch threads per worker.
            heartbeat_s: Seconds between worker heartbeats.
            stop: Set by a signal handler to stop `up`: a KeyboardInterrupt
                raised while Python runs its at-fork handlers (at every
                subprocess start) is swallowed there, so `up` also checks this.
            redis_dir: With a folder, Redis keeps an append-only file there
                (`appendonly yes`), so a Redis killed mid-run starts again from
                it (`services.testbed.chaos`); without, nothing is persisted.
            spare: Devices whose worker and profiler `up` does not start: they
                join later (`start_device`), as a device switched on mid-job.

        """
        self.spec, self.log_dir = spec, log_dir
        self.tag = net.check_tag(tag) if tag else net.new_tag()
        self.cluster = cluster or spec.name
        self.threads, self.heartbeat_s = threads, heartbeat_s
        self.netem = False
        self.stop = stop or threading.Event()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._cgroups: dict[str, DeviceCgroup] = {}
        self._redis: EmbeddedRedis | None = None
        self._coordinator: str | None = None
        self._killed: set[str] = set()
        self._owner: dict[str, str] = {}  # process name -> device it runs in
        self._touched = False
        self.redis_dir = redis_dir
        self.spare = {spec.device(d).name for d in spare}
        self.coordinator_args: list[str] = []
        """Extra coordinator arguments (e.g. `--job FILE`), for `start_coordinator`."""
        self._gone: set[str] = set()  # processes stopped on purpose (not by device)

    # --- what the services and tests need -------------------------------------

    @property
    def devices(self) -> list[str]:
        """Device names, in the spec's order."""
        return self.spec.names()

    @property
    def redis_url(self) -> str:
        """The Redis of the testbed's services (on the bridge address)."""
        if self._redis is None:
            raise AsteroidError("the testbed's services are not running (up(services=True))")
        return self._redis.url

    @property
    def coordinator(self) -> str:
        """The coordinator's control-plane address."""
        if self._coordinator is None:
            raise AsteroidError("the testbed's services are not running (up(services=True))")
        return self._coordinator

    @property
    def bridge(self) -> str:
        """The host side's address on the testbed subnet."""
        return self.spec.bridge_address()

    def address(self, dev: str) -> str:
        """The IPv4 address of device `dev`."""
        return self.spec.address(dev)

    def netns(self, dev: str) -> str:
        """The network namespace of device `dev`."""
        return net.netns_name(self.tag, self.spec.device(dev).name)

    def cgroup(self, dev: str) -> DeviceCgroup:
        """The cgroups of device `dev` (after `up`)."""
        self.spec.device(dev)
        if dev not in self._cgroups:
            raise AsteroidError(f"device {dev} has no cgroup: the testbed is not up")
        return self._cgroups[dev]

    # --- lifecycle ----------------------------------------------------------------

    def up(self, services: bool = True, ready_timeout_s: float = 300.0) -> Testbed:
        """Create the network and cgroups; with `services`, start everything and wait for it.

        Waits until every worker and profiler has joined the coordinator (up to
        `ready_timeout_s`: importing torch under a 0.13-core quota takes a while).
        On any failure what was created is removed before the error propagates.

        Raises:
            ConfigError: Not root, or the subnet is already in use on this machine.
            AsteroidError: A command failed or a service died while starting.

        """
        require_root()
        clash = net.overlaps(self.spec.subnet)
        if clash:
            raise ConfigError(
                f"subnet {self.spec.subnet} is already in use here ({'; '.join(clash)}): pick "
                "another (--subnet), or remove a testbed left behind with `asteroid testbed down`"
            )
        for warning in self.spec.warnings():
            log.warning("testbed", warning=warning)
        self._touched = True
        try:
            self._build()
            if services:
                self.start_services()
                self.wait_ready(ready_timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        iptables = shutil.which("iptables") is not None
        net.run_all(net.bridge_commands(self.tag, self.spec.subnet, self.bridge, iptables))
        self.netem = net.netem_available(net.bridge_name(self.tag))
        if not self.netem and any(d.latency_ms > 0 for d in self.spec.devices):
            log.warning("this kernel has no netem queue: links get no added latency")
        for i, d in enumerate(self.spec.devices):
            net.run_all(
                net.device_commands(self.tag, i, d.name, self.spec.subnet, self.address(d.name))
            )
            net.run_all(
                net.link_commands(
                    self.tag, i, d.name, d.bandwidth_bps, d.latency_ms, d.loss_pct, self.netem
                )
            )
            cg = DeviceCgroup(self.tag, d.name)
            self._cgroups[d.name] = cg
            cg.create(d.cpu, d.memory_bytes, cpus=d.cpus)
            self._check_stop()

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt("the testbed was asked to stop")

    def env(self) -> dict[str, str]:
        """The environment every service of the testbed gets (with the testbed's key set)."""
        env = service_env(
            self.redis_url, self.cluster, self.coordinator, self.heartbeat_s, self.threads
        )
        return {**env, "ASTEROID_KEYS": str(self.keys)}

    @property
    def keys(self) -> Path:
        """The CURVE key set of the testbed's services and its operator.

        The coordinator binds the bridge, beyond loopback, and refuses to without
        one; operators (the CLI, tests, benches) set ASTEROID_KEYS to it to submit.
        """
        return self.log_dir / "keys"

    def profiler_keys(self) -> Path:
        """The set as a profiler sees it: its folder's only service secret is "profiler"."""
        return self.log_dir / "keys-profiler"

    def _make_keys(self) -> None:
        create_key_set(self.keys, self.devices, ["planner", "profiler"], ["operator"])
        shutil.rmtree(self.profiler_keys(), ignore_errors=True)
        shutil.copytree(self.keys, self.profiler_keys())
        (self.profiler_keys() / FOLDERS["service"] / "planner.key_secret").unlink()

    def start_services(self) -> None:
        """Redis, coordinator and planner on the host side; a worker and a profiler per device."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._make_keys()
        self._redis = self._new_redis(0).__enter__()
        self._coordinator = f"tcp://{self.bridge}:{_free_port(self.bridge)}"
        self.start_coordinator()
        self.procs["planner"] = spawn(
            service_command("planner"), self.env(), self.log_dir / "planner.log"
        )
        self._check_stop()
        for dev in self.devices:
            if dev not in self.spare:
                self.start_device(dev)
                self._check_stop()

    def _new_redis(self, port: int) -> EmbeddedRedis:
        """The testbed's Redis on the bridge (at `port`, 0: a free one), AOF in `redis_dir`."""
        return EmbeddedRedis(host=self.bridge, port=port, state_dir=self.redis_dir)

    def start_coordinator(self, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start the coordinator at its address, with `coordinator_args` and `extra`.

        Its log is appended to, so a restarted coordinator's lines follow the
        killed one's.
        """
        spec_file = self.log_dir / "cluster-spec.yaml"
        planned = cluster_spec(self.spec)
        spec_file.write_text(yaml.safe_dump(planned.model_dump(mode="json")))
        coordinator = [*service_command("coordinator"), "--bind", self.coordinator]
        coordinator += ["--redis-url", self.redis_url, "--cluster-spec", str(spec_file)]
        cmd = [*coordinator, *self.coordinator_args, *extra]
        self._gone.discard("coordinator")
        self.procs["coordinator"] = spawn(cmd, self.env(), self.log_dir / "coordinator.log")
        return self.procs["coordinator"]

    def start_device(self, dev: str) -> None:
        """Start device `dev`'s worker and profiler (at `up`, or when a spare device joins)."""
        self.start_worker(dev)
        profiler = [*service_command("profiler"), "--serve", "--coordinator", self.coordinator]
        profiler += ["--keys", str(self.profiler_keys())]
        self.start(dev, f"{dev}.profiler", [*profiler, "--redis-url", self.redis_url], "profiler")

    def start_worker(self, dev: str, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start (or, after a crash or an out-of-memory kill, restart) device `dev`'s worker.

        The worker is given the budget the planner plans with outright: it then
        reports it, and it and its profiler name the device alike. `extra`: more
        worker arguments.
        """
        budget = str(cluster_spec(self.spec).device(dev).memory_bytes)
        worker = [*service_command("worker"), "--device", dev, *extra]
        worker += ["--threads", str(self.threads), "--memory-budget", budget]
        self._killed.discard(dev)
        return self.start(dev, f"{dev}.worker", [*worker, "--coordinator", self.coordinator])

    def start(
        self, dev: str, name: str, cmd: Sequence[str], role: str = "worker"
    ) -> subprocess.Popen[bytes]:
        """Start `cmd` inside device `dev` (namespace, cgroup leaf `role`, host name).

        The process gets its own session and dies with this one, logs to
        ``<log_dir>/<name>.log``, and is checked and stopped with the services.
        """
        self._not_paused(dev)
        log_file = self.log_dir / f"{name}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        env = self.env() if self._redis is not None else dict(os.environ)
        with log_file.open("ab") as out:
            proc = subprocess.Popen(
                list(cmd),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=self._enter(dev, role),
            )
        self.procs[name], self._owner[name] = proc, dev
        return proc

    def run(
        self, dev: str, cmd: Sequence[str], timeout_s: float = 60.0, role: str = "worker"
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside device `dev` to its end; its output is returned, not logged."""
        self._not_paused(dev)
        return subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            preexec_fn=self._enter(dev, role),
        )

    def _enter(self, dev: str, role: str) -> Callable[[], None]:
        return _enter_device(self.netns(dev), self.cgroup(dev).procs_files(role), dev)

    def _not_paused(self, dev: str) -> None:
        """Refuse to start a process in a frozen device: it would freeze before its exec."""
        if self.cgroup(dev).frozen():
            raise AsteroidError(f"device {dev} is paused: resume it before starting processes")

    def _joined(self) -> tuple[set[str], set[str]]:
        """(workers, devices with a profiler) the coordinator has logged as joined."""
        workers: set[str] = set()
        profilers: set[str] = set()
        path = self.log_dir / "coordinator.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "worker joined":
                    workers.add(str(event.get("worker")))
                elif event.get("event") == "service joined":
                    service = str(event.get("service", ""))
                    name = service.rpartition("/")[2]  # "profiler/profiler-<host>-<pid>"
                    profilers.update(d for d in self.devices if name.startswith(f"profiler-{d}-"))
        return workers, profilers

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every device's worker and profiler have joined the coordinator.

        Raises:
            ServiceDied: A service exited meanwhile (with its log's tail).
            AsteroidError: Not all joined within `timeout_s`.

        """
        deadline = time.monotonic() + timeout_s
        want = set(self.devices) - self.spare
        while True:
            self._check_stop()
            self.check()
            workers, profilers = self._joined()
            if want <= workers and want <= profilers:
                return
            if time.monotonic() > deadline:
                raise AsteroidError(
                    f"within {timeout_s:.0f} s only workers {sorted(workers)} and profilers on "
                    f"{sorted(profilers)} joined (want {sorted(want)}); logs in {self.log_dir}"
                )
            time.sleep(0.5)

    # --- faults -------------------------------------------------------------------

    def kill(self, dev: str) -> None:
        """SIGKILL every process of device `dev` (a crash, or the power cord)."""
        self._killed.add(dev)
        self.cgroup(dev).kill()
        for name, proc in self.procs.items():
            if self._owner.get(name) == dev and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)

    def pause(self, dev: str) -> None:
        """Freeze device `dev`: its processes stop mid-instruction, sockets stay open."""
        self.cgroup(dev).freeze()

    def resume(self, dev: str) -> None:
        """Thaw a paused device."""
        self.cgroup(dev).thaw()

    def slow(self, dev: str, cpu: float) -> None:
        """Give device `dev` a new CPU quota in cores (e.g. a thermal throttle)."""
        self.cgroup(dev).set_cpu(cpu)

    def cut(self, dev: str) -> None:
        """Drop every packet to and from device `dev` (the link stays up, as a dead switch port)."""
        self._loss(dev, 100.0)

    def heal(self, dev: str) -> None:
        """Undo `cut`: the link loses only its configured share again."""
        self._loss(dev, self.spec.device(dev).loss_pct)

    def _loss(self, dev: str, pct: float) -> None:
        i = self.spec.index(dev)
        net.run_all(net.loss_commands(net.NS_IFACE, self.netns(dev), pct))
        net.run_all(net.loss_commands(net.host_veth(self.tag, i), None, pct))

    def peak_memory(self, dev: str) -> int:
        """Most bytes device `dev`'s worker (or what `start`/`run` put there) has used."""
        return self.cgroup(dev).peak_memory("worker")

    def oom_kills(self, dev: str) -> int:
        """Processes of device `dev` the kernel killed for exceeding its memory limit."""
        return self.cgroup(dev).oom_kills()

    # --- health and teardown ----------------------------------------------------

    def check(self) -> None:
        """Raise ServiceDied if a process exited on its own (killed devices excepted)."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if name in self._gone:
                continue
            if code is not None and self._owner.get(name) not in self._killed:
                raise ServiceDied(f"{name} exited with code {code}:\n{self.tail(name)}")

    def pids(self) -> list[int]:
        """Process ids of every process the testbed started, Redis included."""
        out = [p.pid for p in self.procs.values()]
        if self._redis is not None and self._redis.proc is not None:
            out.append(self._redis.proc.pid)
        return out

    def tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a process's log."""
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def down(self) -> None:
        """Stop every process, then remove namespaces, links and cgroups (idempotent).

        Ctrl-C and SIGTERM are held off while this runs (in the main thread),
        so that a second Ctrl-C cannot leave half a testbed behind.
        """
        if not self._touched:
            return
        held: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for cg in self._cgroups.values():  # frozen processes cannot act on SIGTERM
                with contextlib.suppress(AsteroidError):
                    cg.thaw()
            stop_all(list(self.procs.values()), timeout_s=8.0)
            if self._redis is not None:
                self._redis.stop()
            remove(find(self.tag).get(self.tag, Found(self.tag)))  # this tag exactly
            self._touched = False
            self._cgroups.clear()
        finally:
            for signum, handler in held.items():
                if handler is not None:
                    signal.signal(signum, handler)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()
