"""One Galaxy ring step against a raw ZeroMQ send of the same bytes, on the same link.

    python -m tests.bench.bench_ring_step [--rows 1,142,284] [--hidden 768] [--steps 200]
        [--host 127.0.0.1] [--out FILE.json]

Two processes pass a tile back and forth. The ring form is what serving runs:
`ZmqRing.send` -> the `Dispatcher` thread -> the peer's `Receiver` thread ->
`TileInbox` -> `ZmqRing.recv`, with every check the inbox makes. The raw form
is a DEALER/ROUTER pair sending the same bytes as one frame from the calling
thread. Half a round trip is one step; the difference is what the ring's code
adds per step, which the cost model then carries as a fixed per-step latency.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from common.codec import Limits
from common.ids import DeviceId
from common.serving_messages import HmpTile
from services.worker.pool import TaskPool
from services.worker.tiles import Expecting, TileInbox, ZmqRing
from services.worker.transport import Dispatcher, Receiver

__all__ = ["main", "raw_step_s", "ring_step_s"]

TIMEOUT_S = 30.0
NAMES = (DeviceId("a"), DeviceId("b"))


def _ring_member(
    me: int, rows: int, hidden: int, steps: int, ports: Any, done: Any, result: Any
) -> None:
    """One device of a two-device ring: send, receive back, `steps` times (device a times it)."""
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = TileInbox(1 << 30)
    recv = Receiver(ctx, "tcp://127.0.0.1:0", Limits(), TaskPool(), tiles=inbox)
    recv.start()
    ports[me] = recv.endpoint
    while len(ports) < 2:
        time.sleep(0.01)
    disp = Dispatcher(ctx, NAMES[me], session="serve")
    disp.start()
    disp.set_peers({NAMES[1 - me]: ports[1 - me]})
    inbox.expect(Expecting("bench", 0, NAMES[1 - me]))
    x = torch.randn(rows, hidden)
    times = []
    for request in range(1, steps + 1):
        inbox.start(request)
        msg = HmpTile(serve_id="bench", epoch=0, round=request, tag="t")
        ring = ZmqRing(list(NAMES), NAMES[me], msg, disp, inbox, lambda: None)
        t0 = time.perf_counter()
        if me == 0:
            ring.send("t/0", x)
            x = ring.recv("t/1", TIMEOUT_S)
        else:
            x = ring.recv("t/0", TIMEOUT_S)
            ring.send("t/1", x)
        times.append(time.perf_counter() - t0)
    if me == 0:
        result["times"] = times
    done.wait(TIMEOUT_S)
    disp.close()
    disp.join(TIMEOUT_S)
    recv.stop.set()
    recv.join(TIMEOUT_S)
    ctx.term()


def ring_step_s(rows: int, hidden: int, steps: int) -> list[float]:
    """Seconds of each ring step (half a round trip) between two worker data planes."""
    with mp.Manager() as m:
        ports, result, done = m.dict(), m.dict(), m.Event()
        procs = [
            mp.Process(target=_ring_member, args=(i, rows, hidden, steps, ports, done, result))
            for i in range(2)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        while "times" not in result and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        for p in procs:
            p.join(TIMEOUT_S)
        return [t / 2 for t in result.get("times", [])]


def _raw_echo(endpoint: Any, steps: int) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hello")  # lets the ROUTER learn this route
    for _ in range(steps):
        if not sock.poll(int(TIMEOUT_S * 1000)):
            break
        sock.send(sock.recv(copy=False), copy=False)
    sock.close(0)
    ctx.term()


def raw_step_s(rows: int, hidden: int, steps: int) -> list[float]:
    """Seconds of each raw ZeroMQ send of the same bytes (half a round trip)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    echo = mp.Process(target=_raw_echo, args=(f"tcp://127.0.0.1:{port}", steps))
    echo.start()
    payload = torch.randn(rows, hidden).numpy().tobytes()
    sock.poll(int(TIMEOUT_S * 1000))
    route, _hello = sock.recv_multipart()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sock.send_multipart([route, payload], copy=False)
        sock.poll(int(TIMEOUT_S * 1000))
        sock.recv_multipart(copy=False)
        times.append((time.perf_counter() - t0) / 2)
    echo.join(TIMEOUT_S)
    sock.close(0)
    ctx.term()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", default="1,142,284")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    out = []
    print("| rows | bytes | raw ZeroMQ ms | ring step ms | ring - raw ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        raw = statistics.median(raw_step_s(r, args.hidden, args.steps))
        ring = statistics.median(ring_step_s(r, args.hidden, args.steps))
        nbytes = r * args.hidden * 4
        out.append({"rows": r, "bytes": nbytes, "raw_s": raw, "ring_s": ring})
        print(f"| {r} | {nbytes} | {raw * 1e3:.3f} | {ring * 1e3:.3f} | {(ring - raw) * 1e3:.3f} |")
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
