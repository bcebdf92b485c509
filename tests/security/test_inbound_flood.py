"""One endless multipart message, and a crowd of half-open connections, bound nothing.

Real coordinator and worker processes; the attacker speaks ZMTP by hand
(`tests.security.zmtp`): 200,000 frames of 4 KiB with the MORE flag and never
a last frame grew a coordinator and a worker by ~1.6 GB each before, as ZeroMQ
keeps an unfinished message's frames whatever RCVHWM and MAXMSGSIZE say. Now
each process stays within its memory limit (`common.inbound`), says so in its
log, and serves a new client afterwards; half-open greetings are closed after
the handshake timeout instead of holding their slot.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.messages import CancelJob
from common.sockets import HANDSHAKE_S
from common.store import Store
from tests.cluster import LocalCluster
from tests.security.attacker import Attacker, alive, serving_coordinator
from tests.security.zmtp import endless_message, half_open

MIB = 1 << 20
MARGIN = 64 * MIB
"""The processes' inbound margin (and, for the worker, its memory budget and pool)."""
FRAMES = 200_000
SLACK = 512 * MIB
"""Growth allowed beyond the limit: what arrives between two checks of the guard on a
loaded machine (a few hundred MB at worst); without the guard the flood adds ~1.6 GB."""


@pytest.fixture
def cluster(tmp_path: Path, redis_url: str, cluster_name: str) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path, redis_url, cluster_name)
    c.env["ASTEROID_INBOUND_MARGIN"] = str(MARGIN)
    c.env["ASTEROID_MEMORY_BUDGET"] = str(MARGIN)
    c.env["ASTEROID_POOL_MAX_BYTES"] = str(MARGIN)
    yield c
    c.close()


def rss(pid: int) -> int:
    """Resident bytes of process `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def flood_and_watch(pid: int, host: str, port: int) -> tuple[int, int]:
    """(RSS before, highest RSS during) an endless message sent to `host:port`."""
    before = rss(pid)
    peak = before
    result: list[int] = []

    def send() -> None:
        conn, sent = endless_message(host, port, FRAMES)
        result.append(sent)
        conn.close()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    deadline = time.monotonic() + 120
    while sender.is_alive() and time.monotonic() < deadline:
        peak = max(peak, rss(pid))
        time.sleep(0.02)
    sender.join(5)
    assert not sender.is_alive(), "the flood did not end within 120 s"
    return before, peak


def test_the_coordinator_stays_bounded_and_serves_after_an_endless_message(
    cluster: LocalCluster,
) -> None:
    first = serving_coordinator(cluster)
    first.close()
    pid = cluster.procs["coordinator"].pid
    before, peak = flood_and_watch(pid, "127.0.0.1", cluster.port)
    assert peak - before < MARGIN + SLACK, f"grew {(peak - before) / MIB:.0f} MiB"
    alive(cluster)
    client = Attacker(cluster.addr, "newcomer")
    try:
        assert not client.ask(CancelJob(job_id="nobody"), timeout_s=30).ok  # served
    finally:
        client.close()
    resets = [e for e in cluster.log_events("coordinator") if "reset the control" in e["event"]]
    assert resets, cluster.log_tail("coordinator")


def test_a_worker_stays_bounded_and_keeps_heartbeating_after_an_endless_message(
    cluster: LocalCluster, store: Store
) -> None:
    serving_coordinator(cluster).close()
    cluster.start_workers(["w"])
    deadline = time.monotonic() + 60
    while not store.get_fields("device", "w").get("data_addr"):
        assert time.monotonic() < deadline, cluster.log_tail("w")
        time.sleep(0.1)
    time.sleep(3)  # past the worker's warm-up: its guard is set when it starts serving
    port = int(store.get_fields("device", "w")["data_addr"].rsplit(":", 1)[1])
    pid = cluster.procs["w"].pid
    before, peak = flood_and_watch(pid, "127.0.0.1", port)
    assert peak - before < 3 * MARGIN + SLACK, f"grew {(peak - before) / MIB:.0f} MiB"
    alive(cluster, "w")
    seen = float(store.get_fields("device", "w")["seen"])
    deadline = time.monotonic() + 10
    while float(store.get_fields("device", "w")["seen"]) == seen:  # still heartbeating
        assert time.monotonic() < deadline, cluster.log_tail("w")
        time.sleep(0.1)
    resets = [e for e in cluster.log_events("w") if "reset the data socket" in e["event"]]
    assert resets, cluster.log_tail("w")


def was_closed(conn: socket.socket) -> bool:
    """Whether the server closed `conn` (past the greeting bytes it sent first)."""
    conn.settimeout(0.01)
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_half_open_connections_are_closed_and_keep_nobody_out(cluster: LocalCluster) -> None:
    serving_coordinator(cluster).close()
    conns = half_open("127.0.0.1", cluster.port, 1_100)
    try:
        client = Attacker(cluster.addr, "newcomer")
        try:
            assert not client.ask(CancelJob(job_id="nobody"), timeout_s=30).ok
        finally:
            client.close()
        time.sleep(HANDSHAKE_S + 1)
        closed = sum(map(was_closed, conns))
        assert closed >= len(conns) * 0.9, f"{closed} of {len(conns)} half-open closed"
    finally:
        for conn in conns:
            conn.close()
