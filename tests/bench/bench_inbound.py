"""Inbound floods: one endless multipart message, and a crowd of half-open connections.

    python -m tests.bench.bench_inbound [--out DIR] [--frames N] [--half-open N]

Endless message: a real coordinator process (no job) receives `--frames` frames
of 4 KiB with the MORE flag and never a last one (hand-written ZMTP, as an
attacker sends them), once with its memory guard (`common.inbound`, margin
64 MiB) and once with the guard out of reach (margin 1 TiB: ZeroMQ alone).
For each: the coordinator's RSS before, at its peak and 2 s after the sender
left, the socket resets it logged, and how long a new client then waits for
an answer.

Half-open: `--half-open` connections send half a ZMTP greeting and wait; then a
new client asks a question. Side by side, in a process whose soft limit of open
files is 1,024 (a common default): a ROUTER with ZeroMQ's defaults (handshake
timeout 30 s, the limit as it is) and one from `bind_router` (5 s, the limit
raised to the hard one). For each: how long the new client waits, and how long
the half-open connections are held.

Redis: the one at ASTEROID_REDIS_URL (default 127.0.0.1:6379). Written, with
`--out`, as inbound.md and inbound.csv; exit 0 when every run completed.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from common.codec import Limits, recv_message, send_message
from common.errors import ProtocolError
from common.messages import CancelJob, JobReply
from common.sockets import HANDSHAKE_S, bind_router, connect_dealer
from tests.cluster import LocalCluster
from tests.security.attacker import Attacker, serving_coordinator
from tests.security.test_inbound_flood import rss, was_closed
from tests.security.zmtp import endless_message, half_open

MIB = 1 << 20
GUARDED = 64 * MIB
UNGUARDED = 1 << 40
SOFT_FILES = 1_024
"""Open files a process may hold before it raises its own limit (a common default)."""


def _served_in(address: str, timeout_s: float = 60.0) -> float:
    """Seconds until a new client's CancelJob is answered by the coordinator at `address`."""
    started = time.monotonic()
    client = Attacker(address, "newcomer")
    try:
        client.ask(CancelJob(job_id="nobody"), timeout_s=timeout_s)
    finally:
        client.close()
    return time.monotonic() - started


def endless(redis_url: str, margin: int, frames: int) -> dict[str, Any]:
    """One endless message against a coordinator whose inbound margin is `margin`."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), redis_url, f"bench-{uuid.uuid4().hex[:8]}")
        cluster.env["ASTEROID_INBOUND_MARGIN"] = str(margin)
        try:
            serving_coordinator(cluster).close()
            pid = cluster.procs["coordinator"].pid
            before = peak = rss(pid)
            sent: list[int] = []

            def send() -> None:
                conn, n = endless_message("127.0.0.1", cluster.port, frames)
                sent.append(n)
                conn.close()

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            while sender.is_alive():
                peak = max(peak, rss(pid))
                time.sleep(0.02)
            time.sleep(2)
            after = rss(pid)
            served = _served_in(cluster.addr)
            resets = sum(
                "reset the control" in e["event"] for e in cluster.log_events("coordinator")
            )
        finally:
            cluster.close()
    return {
        "case": "guard 64 MiB" if margin == GUARDED else "ZeroMQ alone",
        "frames_sent": sent[0] if sent else 0,
        "rss_before_mib": round(before / MIB),
        "rss_peak_mib": round(peak / MIB),
        "rss_after_mib": round(after / MIB),
        "resets": resets,
        "new_client_s": round(served, 3),
    }


def serve(defaults: bool) -> None:
    """The server of the half-open case, in a process of its own: answer until stdin closes.

    Its soft limit of open files is `SOFT_FILES`; `bind_router` raises it, ZeroMQ does not.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SOFT_FILES, hard), hard))
    ctx: zmq.Context[Any] = zmq.Context()
    if defaults:
        sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        sock.bind("tcp://127.0.0.1:*")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits())
    print(endpoint, flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        if sock.poll(50, zmq.POLLIN):
            try:
                _, env = recv_message(sock, Limits(), routed=True)
            except ProtocolError:
                continue
            send_message(sock, JobReply(job_id="", ok=False, error="no"), "s", route=env.route)
    sock.close(0)
    ctx.term()


def half_open_case(ctx: zmq.Context[Any], defaults: bool, count: int) -> dict[str, Any]:
    """A new client's wait, and how long `count` half-open connections are held."""
    args = [sys.executable, "-m", "tests.bench.bench_inbound", "--serve"]
    server = subprocess.Popen(
        [*args, "defaults" if defaults else "bind_router"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        endpoint = server.stdout.readline().strip()
        port = int(endpoint.rsplit(":", 1)[1])
        conns = half_open("127.0.0.1", port, count)
        started = time.monotonic()
        client = connect_dealer(ctx, endpoint, "newcomer")
        send_message(client, CancelJob(job_id="x"), "newcomer")
        answered = client.poll(60_000, zmq.POLLIN)
        served = time.monotonic() - started if answered else float("inf")
        client.close(0)
        held = float("inf")
        while time.monotonic() - started < 45:
            if sum(map(was_closed, conns)) >= 0.9 * count:
                held = time.monotonic() - started
                break
            time.sleep(0.5)
        for conn in conns:
            conn.close()
        server.stdin.close()
        server.wait(10)
    finally:
        server.kill()
        server.wait()
    return {
        "case": "ZeroMQ defaults (30 s)" if defaults else f"bind_router ({HANDSHAKE_S:g} s)",
        "half_open": count,
        "new_client_s": round(served, 3),
        "held_s": round(held, 1),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run both floods side by side, print the tables and write them to `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write inbound.{md,csv} here")
    parser.add_argument("--frames", type=int, default=100_000, help="frames of the message")
    parser.add_argument("--half-open", type=int, default=1_100, help="half-open connections")
    parser.add_argument("--serve", choices=["defaults", "bind_router"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve == "defaults")
        return 0
    redis_url = os.environ.get("ASTEROID_REDIS_URL", "redis://127.0.0.1:6379/0")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.half_open)), hard))
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        crowd = [half_open_case(ctx, d, args.half_open) for d in (True, False)]
    finally:
        ctx.destroy(0)
    memory = [endless(redis_url, m, args.frames) for m in (GUARDED, UNGUARDED)]
    command = "python -m tests.bench.bench_inbound " + " ".join(argv or sys.argv[1:])
    text = (
        f"# Inbound floods\n\n`{command.strip()}`\n\n## One endless multipart message "
        f"({args.frames} frames of 4 KiB, MORE set)\n\n{_table(memory)}\n\n"
        f"## Half-open connections\n\n{_table(crowd)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "inbound.md").write_text(text)
        with (args.out / "inbound.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            for rows in (memory, crowd):
                writer.writerow(rows[0].keys())
                writer.writerows(r.values() for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
