"""The ring step micro-benchmark over a shaped veth link between two network namespaces (root).

    python -m tests.bench.bench_ring_step_veth [--mbit 125,1000] [--rows 1,142,284]
        [--hidden 768] [--steps 100] [--cpu 1.0]

Two namespaces joined by a veth pair shaped as the testbed shapes a device's
link (`services.testbed.net.shaping_commands`, both ends), one process in each.
Per rate and tile size: a raw ZeroMQ DEALER/ROUTER echo of the same bytes and
the ring step serving runs (`ZmqRing` -> `Dispatcher` -> `Receiver` ->
`TileInbox`), each half a round trip, median after a warm-up. With `--cpu` below 1 each
process runs in a cgroup with that CPU quota, as the testbed's devices do
(`services.testbed.cgroups`: a 10 ms CFS period); with `--busy-ms` device a
computes that much CPU time before each ring step (not counted), as a device
does between the steps of a layer, so its quota is spent when the step starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from common.codec import Limits
from common.ids import DeviceId
from common.serving_messages import HmpTile
from services.testbed import net
from services.testbed.cgroups import DeviceCgroup
from services.worker.pool import TaskPool
from services.worker.tiles import Expecting, TileInbox, ZmqRing
from services.worker.transport import Dispatcher, Receiver

__all__ = ["main"]

NS = ("rsb-a", "rsb-b")
ADDR = ("10.99.7.1", "10.99.7.2")
IFACE = ("rsb0", "rsb1")
RING_PORT, RAW_PORT = 5701, 5702
TIMEOUT_S = 30.0
WARMUP = 5
NAMES = (DeviceId("a"), DeviceId("b"))
MODULE = "tests.bench.bench_ring_step_veth"


def _up(mbit: float) -> None:
    _down()
    cmds: list[list[str]] = [
        ["ip", "netns", "add", NS[0]],
        ["ip", "netns", "add", NS[1]],
        ["ip", "link", "add", IFACE[0], "netns", NS[0], "type", "veth", "peer", "name", IFACE[1]],
        ["ip", "link", "set", IFACE[1], "netns", NS[1]],
    ]
    for i in range(2):
        cmds += [
            ["ip", "-n", NS[i], "addr", "add", f"{ADDR[i]}/24", "dev", IFACE[i]],
            ["ip", "-n", NS[i], "link", "set", IFACE[i], "up"],
            ["ip", "-n", NS[i], "link", "set", "lo", "up"],
            *net.shaping_commands(IFACE[i], NS[i], mbit * 1e6),
        ]
    net.run_all(cmds)


def _down() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _busy(seconds: float) -> None:
    """Compute for `seconds` of this process's CPU time, as a device between ring steps."""
    a = torch.randn(64, 64)
    end = time.process_time() + seconds
    while time.process_time() < end:
        a = torch.tanh(a @ a)


def _ring(me: int, rows: int, hidden: int, steps: int, busy_s: float = 0.0) -> list[float]:
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = TileInbox(1 << 30)
    recv = Receiver(ctx, f"tcp://{ADDR[me]}:{RING_PORT}", Limits(), TaskPool(), tiles=inbox)
    recv.start()
    disp = Dispatcher(ctx, NAMES[me], session="serve")
    disp.start()
    disp.set_peers({NAMES[1 - me]: f"tcp://{ADDR[1 - me]}:{RING_PORT}"})
    inbox.expect(Expecting("bench", 0, NAMES[1 - me]))
    x = torch.randn(rows, hidden)
    times = []
    for request in range(1, steps + WARMUP + 1):
        inbox.start(request)
        msg = HmpTile(serve_id="bench", epoch=0, round=request, tag="t")
        ring = ZmqRing(list(NAMES), NAMES[me], msg, disp, inbox, lambda: None)
        if me == 0 and busy_s:
            _busy(busy_s)  # device a computes, then the step starts
        t0 = time.perf_counter()
        if me == 0:
            ring.send("t/0", x)
            x = ring.recv("t/1", TIMEOUT_S)
        else:
            x = ring.recv("t/0", TIMEOUT_S)
            ring.send("t/1", x)
        times.append((time.perf_counter() - t0) / 2)
    time.sleep(0.5)  # the last tile leaves before the sockets close
    disp.close()
    disp.join(TIMEOUT_S)
    recv.stop.set()
    recv.join(TIMEOUT_S)
    ctx.term()
    return times[WARMUP:]


def _raw(me: int, rows: int, hidden: int, steps: int) -> list[float]:
    ctx: zmq.Context[Any] = zmq.Context()
    times = []
    if me == 1:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{ADDR[0]}:{RAW_PORT}")
        sock.send(b"hello")
        for _ in range(steps + WARMUP):
            if not sock.poll(int(TIMEOUT_S * 1000)):
                break
            sock.send(sock.recv(copy=False), copy=False)
    else:
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://{ADDR[0]}:{RAW_PORT}")
        payload = torch.randn(rows, hidden).numpy().tobytes()
        sock.poll(int(TIMEOUT_S * 1000))
        route, _hello = sock.recv_multipart()
        for _ in range(steps + WARMUP):
            t0 = time.perf_counter()
            sock.send_multipart([route, payload], copy=False)
            sock.poll(int(TIMEOUT_S * 1000))
            sock.recv_multipart(copy=False)
            times.append((time.perf_counter() - t0) / 2)
    time.sleep(0.2)
    sock.close(0)
    ctx.term()
    return times[WARMUP:]


def _pair(kind: str, rows: int, hidden: int, steps: int, cpu: float, busy_s: float) -> float:
    """Run one measurement: device b's process, then device a's; a's median step."""
    procs = []
    groups = [DeviceCgroup("rsb", f"dev{me}") for me in (0, 1)]
    if cpu < 1.0:
        for g in groups:
            g.create(cpu, 4 << 30)
    for me in (1, 0):
        cmd = ["ip", "netns", "exec", NS[me], sys.executable, "-m", MODULE]
        cmd += ["--role", f"{kind}-{me}", "--rows", str(rows), "--hidden", str(hidden)]
        cmd += ["--steps", str(steps), "--busy-ms", str(busy_s * 1000)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
        if cpu < 1.0:
            groups[me].attach(proc.pid)
        procs.append(proc)
        time.sleep(1.0 if me == 1 else 0.0)
    try:
        out, _ = procs[1].communicate(timeout=300)
        procs[0].wait(timeout=60)
    finally:
        if cpu < 1.0:
            for g in groups:
                g.remove()
    return float(statistics.median(json.loads(out.strip().splitlines()[-1])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mbit", default="125,1000")
    parser.add_argument("--rows", default="1,142,284")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cpu", type=float, default=1.0, help="cores per process (quota)")
    parser.add_argument(
        "--busy-ms", type=float, default=0.0, help="CPU ms device a computes before each step"
    )
    parser.add_argument("--role", default="")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.role:
        kind, me = args.role.split("-")
        if kind == "ring":
            got = _ring(int(me), int(args.rows), args.hidden, args.steps, args.busy_ms / 1000)
        else:
            got = _raw(int(me), int(args.rows), args.hidden, args.steps)
        print(json.dumps(got), flush=True)
        return 0
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    results = []
    print("| link Mbit/s | rows | bytes | wire ms | raw ZeroMQ ms | ring step ms | ring - raw ms |")
    print("|---|---|---|---|---|---|---|")
    try:
        for mbit in (float(m) for m in args.mbit.split(",")):
            _up(mbit)
            for rows in (int(r) for r in args.rows.split(",")):
                raw = _pair("raw", rows, args.hidden, args.steps, args.cpu, 0.0)
                ring = _pair("ring", rows, args.hidden, args.steps, args.cpu, args.busy_ms / 1000)
                nbytes = rows * args.hidden * 4
                wire = nbytes * 8 / (mbit * 1e6)
                results.append(
                    {"mbit": mbit, "rows": rows, "bytes": nbytes, "raw_s": raw, "ring_s": ring}
                )
                print(
                    f"| {mbit:g} | {rows} | {nbytes} | {wire * 1e3:.2f} | {raw * 1e3:.2f} | "
                    f"{ring * 1e3:.2f} | {(ring - raw) * 1e3:.2f} |",
                    flush=True,
                )
    finally:
        _down()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
