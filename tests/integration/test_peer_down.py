"""Neighbours report a lost worker at once, over real sockets and real processes.

A data-plane dispatcher watches its connections to a peer process that is
SIGKILLed (the kernel closes its sockets) and started again on the same port;
a flapping peer is reported a bounded number of times; and two real worker
processes, given their stages by a stand-in coordinator (a ROUTER in the
test), report their neighbour killed ("disconnected"), back on its port
("reconnected") and stopped with SIGSTOP ("silent", past the Assign's
neighbour timeout). Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.checkpoint import commit_checkpoint, save_stage
from common.codec import Envelope, Limits, encode, recv_message
from common.ids import DeviceId
from common.job import JobSpec
from common.messages import Assign, Assigned, Heartbeat, Message, PeerDown, RunRound, Shutdown
from common.plan import Plan
from common.ports import free_port
from common.sockets import bind_router
from common.store import Store
from common.zoo import build_model
from services.worker.peer_watch import BURST, SPACING_S
from services.worker.transport import Dispatcher
from tests.bench.bench_peer_down import peer_process
from tests.cluster import Budget, LocalCluster

WAIT_S = 30.0
"""Longest any one expected report may take (milliseconds on an idle machine)."""


def _peer(addr: str) -> subprocess.Popen[str]:
    """A process holding a data ROUTER at `addr`, as a worker's receiver does."""
    return peer_process(addr)[0]


class _Reports:
    """What a dispatcher reported, safe to read from the test's thread."""

    def __init__(self) -> None:
        self.got: list[tuple[int, str, str]] = []
        self.cond = threading.Condition()

    def __call__(self, epoch: int, peer: str, how: str) -> None:
        with self.cond:
            self.got.append((epoch, peer, how))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout_s: float = WAIT_S) -> list[tuple[int, str, str]]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.got) >= n, timeout_s)
            return list(self.got)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _dispatcher(ctx: zmq.Context[Any], reports: _Reports) -> Dispatcher:
    out = Dispatcher(ctx, "a", report=reports)
    out.start()
    return out


def _up(out: Dispatcher, peer: str) -> bool:
    """Whether the dispatcher knows its connection to `peer` up (read from another thread)."""
    link = out.links.links.get(peer)
    return link is not None and link.up is True


def _until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.01)


def test_a_killed_peer_is_reported_and_its_return_on_the_same_port(
    ctx: zmq.Context[Any],
) -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    peer = _peer(addr)
    reports = _Reports()
    out = _dispatcher(ctx, reports)
    try:
        out.set_peers({"b": addr, "c": "tcp://127.0.0.1:1"}, epoch=4, watch={"b"})
        # connected at assignment, before any data: the link is known up
        _until(lambda: _up(out, "b"), "the connection to the neighbour")
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(timeout=WAIT_S)
        assert reports.wait_for(1) == [(4, "b", "disconnected")]
        peer = _peer(addr)  # a new process on the same port
        assert reports.wait_for(2) == [(4, "b", "disconnected"), (4, "b", "reconnected")]
        # a new plan that still names b: nothing to tell, it is up
        out.set_peers({"b": addr}, epoch=5, watch={"b"})
        time.sleep(0.2)
        assert len(reports.got) == 2
    finally:
        out.close()
        out.join(timeout=10)
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
            peer.wait(timeout=10)


def test_a_flapping_peer_is_reported_a_bounded_number_of_times(ctx: zmq.Context[Any]) -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    reports = _Reports()
    out = _dispatcher(ctx, reports)
    t0 = time.monotonic()
    try:
        router, _ = bind_router(ctx, addr, Limits())
        out.set_peers({"b": addr}, epoch=1, watch={"b"})
        cycles = 0
        for _ in range(40):  # the peer's socket closes and comes back, again and again
            _until(lambda: _up(out, "b"), "the connection")
            router.close(0)
            router = _rebind(ctx, addr)
            cycles += 1
        # the link ends up: once the spacing allows, the last word is that it is back
        _until(
            lambda: not reports.got or reports.got[-1][2] == "reconnected",
            "the final state",
            timeout_s=WAIT_S,
        )
        elapsed = time.monotonic() - t0
        assert len(reports.got) <= BURST + elapsed / SPACING_S + 1, (cycles, reports.got)
        assert all(epoch == 1 and peer == "b" for epoch, peer, _ in reports.got)
        router.close(0)
    finally:
        out.close()
        out.join(timeout=10)


def _rebind(ctx: zmq.Context[Any], addr: str) -> zmq.Socket[Any]:
    """Bind `addr` again once ZeroMQ has released it (it closes asynchronously)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return bind_router(ctx, addr, Limits())[0]
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"{addr} never came free"
            time.sleep(0.01)


# --- real worker processes --------------------------------------------------------


SGD = {"kind": "sgd", "lr": 0.05}
JOB = {
    "job_id": "peer-down",
    "model": {"name": "small_cnn"},
    "seed": 7,
    "rounds": 4,
    "optimizer": SGD,
}
PLAN = {
    "global_batch": 16,
    "microbatches": 2,
    "stages": [
        {"start": 0, "end": 3, "devices": [{"device": "a", "share": 1}]},
        {"start": 3, "end": 7, "devices": [{"device": "b", "share": 1}]},
    ],
}


class _Coordinator:
    """A stand-in coordinator: a ROUTER the workers join, that sends what the test says."""

    def __init__(self, ctx: zmq.Context[Any], addr: str) -> None:
        self.sock, _ = bind_router(ctx, addr, Limits(), roles=("worker",))
        self.routes: dict[str, bytes] = {}
        self.heard: list[Envelope] = []

    def expect(self, match: Callable[[Message], bool], budget: Budget, what: str) -> Message:
        """The first message (from now on, or heard before) that `match`es."""
        for env in self.heard:
            if match(env.msg):
                self.heard.remove(env)
                return env.msg
        deadline = time.monotonic() + budget.left(WAIT_S * 2)
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            peer, env = recv_message(self.sock, Limits(), routed=True)
            self.routes[peer] = env.route
            if match(env.msg):
                return env.msg
            if not isinstance(env.msg, Heartbeat):
                self.heard.append(env)
        raise AssertionError(f"no {what} within the wait; heard {[e.msg for e in self.heard]}")

    def send(self, device: str, msg: Message) -> None:
        self.sock.send_multipart([self.routes[device], *encode(msg, "coordinator")])


def _joined(coord: _Coordinator, budget: Budget, names: list[str]) -> dict[str, str]:
    """Each worker's data address, from its first heartbeat."""
    addrs: dict[str, str] = {}
    while len(addrs) < len(names):
        beat = coord.expect(
            lambda m: isinstance(m, Heartbeat) and m.device not in addrs, budget, "heartbeat"
        )
        assert isinstance(beat, Heartbeat)
        addrs[str(beat.device)] = beat.data_addr
    return addrs


def _assign(coord: _Coordinator, addrs: dict[str, str], epoch: int, timeout: float) -> None:
    plan = Plan.model_validate(PLAN)
    for device in ("a", "b"):
        coord.send(
            device,
            Assign(
                epoch=epoch,
                job=JobSpec.model_validate(JOB),
                plan=plan,
                stage=plan.stage_of(DeviceId(device)),
                peers=addrs,
                from_round=0,
                total_rounds=4,
                peer_timeout_s=timeout,
            ),
        )


def _peer_down(how: str, peer: str = "b") -> Callable[[Message], bool]:
    return lambda m: isinstance(m, PeerDown) and m.how == how and m.peer == peer


@pytest.mark.timeout(240)
def test_worker_processes_report_a_neighbour_killed_back_and_stopped(
    tmp_path: Path, redis_url: str, cluster_name: str, store: Store, budget: Budget
) -> None:
    full = build_model(JobSpec.model_validate(JOB).model, 7).full()
    save_stage(store, JOB["job_id"], 0, full, None, 0)  # type: ignore[arg-type]
    commit_checkpoint(store, JOB["job_id"], 0, len(full))  # type: ignore[arg-type]
    cluster = LocalCluster(tmp_path, redis_url, cluster_name, heartbeat_s=0.2, budget=budget)
    ctx: zmq.Context[Any] = zmq.Context()
    coord = _Coordinator(ctx, cluster.addr)
    try:
        cluster.start_workers(["a", "b"])
        addrs = _joined(coord, budget, ["a", "b"])
        _assign(coord, addrs, epoch=1, timeout=0.5)
        for _ in range(2):
            coord.expect(lambda m: isinstance(m, Assigned), budget, "Assigned")

        # silent: b stopped (its kernel keeps the connection), a waits for its gradients
        os.killpg(cluster.procs["b"].pid, signal.SIGSTOP)
        coord.send("a", RunRound(epoch=1, round=0))
        silent = coord.expect(_peer_down("silent"), budget, "PeerDown silent from a")
        assert isinstance(silent, PeerDown)
        assert (silent.device, silent.epoch) == ("a", 1) and silent.waited_s >= 0.5

        # killed: the kernel closes b's sockets; a says so at once, in the same epoch
        os.killpg(cluster.procs["b"].pid, signal.SIGKILL)
        cluster.procs["b"].wait(timeout=WAIT_S)
        gone = coord.expect(_peer_down("disconnected"), budget, "PeerDown disconnected")
        assert isinstance(gone, PeerDown) and (gone.device, gone.epoch) == ("a", 1)

        # back: a worker b again, on the same data port
        port = addrs["b"].rsplit(":", 1)[1]
        cluster.env = {**cluster.env, "ASTEROID_DATA_PORT": port}
        cluster.start_workers(["b"])
        back = coord.expect(_peer_down("reconnected"), budget, "PeerDown reconnected")
        assert isinstance(back, PeerDown) and (back.device, back.epoch) == ("a", 1)
        # one report of each kind: nothing more about b was said
        extra = [e.msg for e in coord.heard if isinstance(e.msg, PeerDown)]
        assert extra == [], extra
        for device in ("a", "b"):
            coord.send(device, Shutdown(reason="test over"))
    finally:
        for proc in cluster.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        coord.sock.close(0)
        ctx.destroy(linger=0)


# --- the control link ---------------------------------------------------------------


def test_a_worker_heartbeats_as_soon_as_its_coordinator_connection_is_back(
    ctx: zmq.Context[Any],
) -> None:
    """A drop shorter than the coordinator's grace is heard within it, not a tick later.

    The heartbeat interval is ten minutes: a heartbeat after the reconnection
    can only be the one the reconnection sends.
    """
    from services.worker.control import ControlLink

    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = bind_router(ctx, addr, Limits())
    beat = Heartbeat(device=DeviceId("w"), data_addr="tcp://127.0.0.1:1")
    link = ControlLink(ctx, addr, "w", Limits(), 600.0, lambda: beat, lambda _: None)
    link.start()
    try:
        assert router.poll(int(WAIT_S * 1000)), "no first heartbeat"
        router.recv_multipart()
        _until(lambda: link.connected, "the link to know it is connected")
        router.close(0)  # the coordinator's socket goes, and comes back on its port
        _until(lambda: not link.connected, "the link to see the drop")
        router = _rebind(ctx, addr)
        assert router.poll(int(WAIT_S * 1000)), "no heartbeat after the reconnection"
        _, env = recv_message(router, Limits(), routed=True)
        assert env.msg == beat
    finally:
        link.close()
        router.close(0)
