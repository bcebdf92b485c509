"""How soon a worker's neighbour learns that its peer process died, and that it is back.

    python -m tests.bench.bench_peer_down [--trials N] [--out DIR]

Per trial: a peer process holds a data ROUTER on a loopback port (as a
worker's receiver does); a data-plane `Dispatcher`, as a worker has it once
assigned, watches its connection. The peer is SIGKILLed and the time from the
kill to the dispatcher's "disconnected" report is taken; then a new process
binds the same port and the time from its bind to the "reconnected" report
(ZeroMQ's reconnect interval, 100 ms by default, is most of it). The table
gives median, p90 and maximum of each; printed and, with `--out`, written as
peer_down.md.

Exit code 0 when every trial was reported, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from common.ports import free_port
from services.worker.transport import Dispatcher

WAIT_S = 30.0
"""Longest one report may take before the trial counts as missed."""

_PEER = """
import sys, time, zmq
from common.codec import Limits
from common.sockets import bind_router
ctx = zmq.Context()
sock, _ = bind_router(ctx, sys.argv[1], Limits())
print("bound", flush=True)
time.sleep(600)
"""


def peer_process(addr: str) -> tuple[subprocess.Popen[str], float]:
    """A process holding a data ROUTER at `addr` (as a worker's receiver does), and when it
    said it was bound; the integration test of the reports starts its peers with it too."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER, addr],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline().strip()
    finally:
        proc.stdout.close()
    if line != "bound":
        raise RuntimeError(f"the peer process did not bind {addr}")
    return proc, time.monotonic()


class _Heard:
    """Reports with the time they came, waited for by the bench's thread."""

    def __init__(self) -> None:
        self.got: list[tuple[str, float]] = []
        self.cond = threading.Condition()

    def __call__(self, epoch: int, peer: str, how: str) -> None:
        with self.cond:
            self.got.append((how, time.monotonic()))
            self.cond.notify_all()

    def wait(self, how: str, after: int) -> float | None:
        """When the first `how` report past the first `after` came; None: none in WAIT_S."""
        with self.cond:
            self.cond.wait_for(lambda: any(h == how for h, _ in self.got[after:]), WAIT_S)
            return next((t for h, t in self.got[after:] if h == how), None)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=WAIT_S)


def measure(trials: int) -> tuple[list[float], list[float], int]:
    """Seconds kill -> "disconnected" and bind -> "reconnected" per trial; and trials missed."""
    ctx: zmq.Context[Any] = zmq.Context()
    heard = _Heard()
    out = Dispatcher(ctx, "a", report=heard)
    out.start()
    addr = f"tcp://127.0.0.1:{free_port()}"
    down: list[float] = []
    back: list[float] = []
    missed = 0
    proc, _ = peer_process(addr)
    try:
        out.set_peers({"b": addr}, epoch=1, watch={"b"})
        time.sleep(0.5)  # connected: the first connection is no news
        for _ in range(trials):
            seen = len(heard.got)
            killed = time.monotonic()
            _kill(proc)
            at = heard.wait("disconnected", seen)
            proc, bound = peer_process(addr)
            again = heard.wait("reconnected", seen)
            if at is None or again is None:
                missed += 1
                continue
            down.append(at - killed)
            back.append(again - bound)
            # the next trial's reports come after the burst's spacing: a fresh epoch each
            out.set_peers({"b": addr}, epoch=2 + len(down) + missed, watch={"b"})
            time.sleep(0.2)
    finally:
        _kill(proc)
        out.close()
        out.join(timeout=10)
        ctx.destroy(linger=0)
    return down, back, missed


def _row(name: str, xs: list[float]) -> str:
    if not xs:
        return f"| {name} | - | - | - |"
    ms = sorted(x * 1000 for x in xs)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"| {name} | {statistics.median(ms):.1f} | {p90:.1f} | {ms[-1]:.1f} |"


def report(down: list[float], back: list[float], missed: int, trials: int) -> str:
    """The table, in Markdown."""
    return "\n".join(
        [
            f"Neighbour reports over {trials} trials on loopback ({missed} missed), in ms:",
            "",
            "| report | median | p90 | max |",
            "|---|---|---|---|",
            _row("SIGKILL -> disconnected", down),
            _row("bound again -> reconnected", back),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    down, back, missed = measure(args.trials)
    text = report(down, back, missed, args.trials)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peer_down.md").write_text(text)
    return 0 if missed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
