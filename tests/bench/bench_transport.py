"""Transport benchmark: the worker data plane against raw TCP, ring all-reduce against gloo,
and the cost of CURVE encryption on both.

    python -m tests.bench.bench_transport [--out DIR] [--quick]

All contenders of a comparison run side by side in the same child processes on
loopback, in alternating order, repeated; the report gives medians. Our side is the
real worker path: `Dispatcher` -> DEALER -> ROUTER -> `Receiver` -> `TaskPool`.
Its CURVE twin is the same path built with the keys a worker gets (a key set made
in a temporary directory per run), so "ours" against "ours+CURVE" is the price
of encryption and authentication on the data plane.
Every child pins torch to one thread, kills itself after a deadline (SIGALRM) and
is killed by the parent on exit; every wait on a child is bounded.

Exit code 0 when the run completed (targets met or not), 1 when it failed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import itertools
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from common.codec import Limits
from common.curve import CurveKeys, create_key_set
from common.memory import keep_freed_memory
from common.messages import ReduceChunk
from common.ports import free_port
from services.worker.allreduce import ring_allreduce
from services.worker.pool import TaskPool
from services.worker.transport import Dispatcher, Receiver

KiB, MiB = 1 << 10, 1 << 20
EPOCH = 1
STEP_TIMEOUT_S = 120.0  # longest any single wait on a child or a peer may take
OURS, RAW, GLOO = "ours", "raw TCP", "gloo"
CURVE = "ours+CURVE"
"""Our path with every data-plane socket a CURVE client or server, as with a key set."""
PLAIN = "plain"
"""Baseline label of the CURVE rows: our path without keys."""
SENDER, RECEIVER = "sender", "receiver"
THROUGHPUT_TARGET = 0.80  # ours / raw, for messages of at least 1 MiB
ALLREDUCE_TARGET = 1.50  # ours / gloo
LOCALHOST = "127.0.0.1"

_MP = mp.get_context("forkserver")
_MP.set_forkserver_preload(["torch", "torch.distributed", "zmq", "services.worker.transport"])


@dataclass(frozen=True)
class Config:
    """How much to measure; `quick` trades precision for a run under a minute."""

    sizes: tuple[int, ...] = (4 * KiB, 64 * KiB, MiB, 4 * MiB, 32 * MiB)
    stream_s: float = 0.75  # target duration of one throughput measurement
    stream_repeats: int = 7
    reduce_sizes: tuple[int, ...] = (MiB, 8 * MiB, 32 * MiB)
    reduce_procs: tuple[int, ...] = (2, 3)
    reduce_iters: int = 4  # timed all-reduces per measurement (after one warm-up)
    reduce_repeats: int = 5
    child_deadline_s: int = 900
    curve_sizes: tuple[int, ...] = (MiB, 32 * MiB)  # stream sizes also measured with CURVE


QUICK = Config(
    stream_s=0.08,
    stream_repeats=3,
    reduce_sizes=(MiB, 8 * MiB),
    reduce_iters=2,
    reduce_repeats=2,
    child_deadline_s=120,
)


@dataclass(frozen=True)
class Row:
    """One line of the report: a size measured both ways."""

    bench: str
    procs: int
    nbytes: int
    unit: str
    ours: float
    baseline: str
    base: float
    samples: int

    @property
    def ratio(self) -> float:
        return self.ours / self.base

    @property
    def curve(self) -> bool:
        """A CURVE row: ours with encryption against ours without (no target)."""
        return self.baseline == PLAIN

    @property
    def time_ratio(self) -> float:
        """Time with the subject over time with the baseline, whatever the unit."""
        return self.base / self.ours if self.unit == "MB/s" else self.ratio

    @property
    def target(self) -> str:
        if self.curve:
            return "-"
        if self.bench == "allreduce":
            return f"<= {ALLREDUCE_TARGET:.2f}"
        return f">= {THROUGHPUT_TARGET:.2f}" if self.nbytes >= MiB else "-"

    @property
    def met(self) -> bool | None:
        if self.curve:
            return None
        if self.bench == "allreduce":
            return self.ratio <= ALLREDUCE_TARGET
        return self.ratio >= THROUGHPUT_TARGET if self.nbytes >= MiB else None


# --- child side -------------------------------------------------------------------


def _child_entry(body: Callable[..., None], ctrl: Connection, deadline_s: int, *args: Any) -> None:
    """Run `body` in a child set up like a worker: one torch thread, freed memory kept
    for reuse (for our path and the baselines alike), a hard deadline, errors sent
    to the parent."""
    signal.alarm(deadline_s)  # default action of SIGALRM: the process dies
    torch.set_num_threads(1)
    keep_freed_memory()
    try:
        body(ctrl, *args)
    except BaseException:
        with contextlib.suppress(OSError):
            ctrl.send(("err", traceback.format_exc()))
        raise


def _next_cmd(ctrl: Connection) -> Any:
    if not ctrl.poll(STEP_TIMEOUT_S):
        raise TimeoutError(f"no command from the parent in {STEP_TIMEOUT_S:.0f} s")
    return ctrl.recv()


def _serve(ctrl: Connection, handle: Callable[[Any], Any]) -> None:
    """Answer the parent's commands until it sends None."""
    while (cmd := _next_cmd(ctrl)) is not None:
        ctrl.send(("ok", handle(cmd)))


def _wait_ack(ack: Connection) -> None:
    if not ack.poll(STEP_TIMEOUT_S):
        raise TimeoutError(f"receiver did not acknowledge in {STEP_TIMEOUT_S:.0f} s")
    ack.recv()


def _sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Gather-send all of `bufs` (one syscall per message in the common case)."""
    while bufs:
        sent = sock.sendmsg(bufs)
        while bufs and sent >= bufs[0].nbytes:
            sent -= bufs[0].nbytes
            bufs = bufs[1:]
        if bufs:
            bufs = [bufs[0][sent:], *bufs[1:]]


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("raw TCP peer closed the connection")
        view = view[got:]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.numpy().data.cast("B")


def _send_raw(sock: socket.socket, tensor: torch.Tensor, count: int) -> None:
    body = _bytes_of(tensor)
    prefix = memoryview(struct.pack("<Q", body.nbytes))
    for _ in range(count):
        _sendmsg_all(sock, [prefix, body])


def _recv_raw(sock: socket.socket, count: int) -> torch.Tensor:
    """Each message into a fresh tensor, as the codec does (the pool keeps what it gets)."""
    head = bytearray(8)
    tensor = torch.empty(0)
    for _ in range(count):
        _recv_exact(sock, memoryview(head))
        (nbytes,) = struct.unpack("<Q", head)
        tensor = torch.empty(nbytes // 4)
        _recv_exact(sock, _bytes_of(tensor))
    return tensor


def _send_ours(out: Dispatcher, tensor: torch.Tensor, count: int, round_no: int) -> None:
    for i in range(count):
        msg = ReduceChunk(epoch=EPOCH, round=round_no, stage=0, step=0, chunk=i)
        out.send("receiver", msg, [tensor])


def _take_ours(pool: TaskPool, count: int, round_no: int) -> torch.Tensor:
    pool.begin_round(round_no)
    tensor = torch.empty(0)
    for i in range(count):
        tensor = pool.take_chunk(round_no, 0, i, STEP_TIMEOUT_S)
    return tensor


def _start_receiver(
    ctx: zmq.Context[Any], keys: CurveKeys | None = None
) -> tuple[TaskPool, Receiver]:
    pool = TaskPool()
    pool.reset(EPOCH, 0, (0, 0))
    rx = Receiver(ctx, f"tcp://{LOCALHOST}:0", Limits(), pool, keys=keys)
    rx.start()
    return pool, rx


def _worker_keys(keys_root: str, name: str) -> CurveKeys:
    """The pair a worker named `name` loads from the run's key set."""
    return CurveKeys.load(Path(keys_root), "worker", name)


def _stop_receivers(*receivers: Receiver) -> None:
    """Stop the receiver threads and let them close their sockets (a CURVE server's
    close also stops its context's ZAP handler)."""
    for rx in receivers:
        rx.stop.set()
    for rx in receivers:
        rx.join(timeout=5)


def stream_receiver(ctrl: Connection, ack: Connection, keys_root: str) -> None:
    """Child: receives each stream (ours, ours+CURVE or raw), checks the last tensor,
    acks the sender. The plain and the CURVE receiver each have a context and a pool."""
    receivers = {
        OURS: _start_receiver(zmq.Context()),
        CURVE: _start_receiver(zmq.Context(), _worker_keys(keys_root, RECEIVER)),
    }
    endpoints = {m: rx.endpoint for m, (_, rx) in receivers.items()}
    with socket.create_server((LOCALHOST, 0)) as server:
        server.settimeout(STEP_TIMEOUT_S)
        ctrl.send(("ok", (endpoints, server.getsockname()[1])))
        raw, _ = server.accept()
    raw.settimeout(STEP_TIMEOUT_S)

    def handle(cmd: tuple[str, int, int, int]) -> None:
        method, nbytes, count, round_no = cmd
        if method == RAW:
            last = _recv_raw(raw, count)
        else:
            last = _take_ours(receivers[method][0], count, round_no)
        ack.send(True)
        if last.numel() * 4 != nbytes or last[-1].item() != round_no:
            raise ValueError(f"{method}: last tensor {last.shape} ends in {last[-1].item()}")

    try:
        _serve(ctrl, handle)
    finally:
        _stop_receivers(*(rx for _, rx in receivers.values()))
        raw.close()


def stream_sender(ctrl: Connection, ack: Connection, keys_root: str) -> None:
    """Child: streams `count` tensors of `nbytes` per command, answers with the seconds.

    One dispatcher per method, each with its own context, so neither shares
    ZeroMQ's I/O thread with the other.
    """
    endpoints, tcp_port = _next_cmd(ctrl)
    outs = {
        OURS: Dispatcher(zmq.Context(), SENDER),
        CURVE: Dispatcher(zmq.Context(), SENDER, keys=_worker_keys(keys_root, SENDER)),
    }
    for method, out in outs.items():
        out.start()
        out.set_peers({RECEIVER: endpoints[method]})
    raw = socket.create_connection((LOCALHOST, tcp_port), timeout=STEP_TIMEOUT_S)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as ZeroMQ does
    ctrl.send(("ok", None))

    def handle(cmd: tuple[str, int, int, int]) -> float:
        method, nbytes, count, round_no = cmd
        tensor = torch.full((nbytes // 4,), float(round_no))
        start = time.perf_counter()
        if method == RAW:
            _send_raw(raw, tensor, count)
        else:
            _send_ours(outs[method], tensor, count, round_no)
        _wait_ack(ack)
        for out in outs.values():
            if out.error is not None:
                raise RuntimeError(f"dispatcher failed: {out.error}")
        return time.perf_counter() - start

    try:
        _serve(ctrl, handle)
    finally:
        for out in outs.values():
            out.close()
        raw.close()


def _device(rank: int) -> str:
    return f"bench-{rank}"


def _gloo_allreduce(flat: torch.Tensor, _round: int) -> torch.Tensor:
    dist.all_reduce(flat)
    return flat


def _ours_allreduce(
    rank: int, world: int, out: Dispatcher, pool: TaskPool
) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """ring_allreduce wired exactly as `StageRunner._allreduce` wires it."""
    nxt = _device((rank + 1) % world)

    def reduce(flat: torch.Tensor, round_no: int) -> torch.Tensor:
        def send(step: int, chunk: int, tensor: torch.Tensor) -> None:
            msg = ReduceChunk(epoch=EPOCH, round=round_no, stage=0, step=step, chunk=chunk)
            out.send(nxt, msg, [tensor])

        def recv(step: int, chunk: int) -> torch.Tensor:
            return pool.take_chunk(round_no, step, chunk, STEP_TIMEOUT_S)

        return ring_allreduce(flat, rank, world, send, recv)

    return reduce


def _time_allreduce(
    reduce: Callable[[torch.Tensor, int], torch.Tensor],
    pool: TaskPool | None,
    rank: int,
    world: int,
    cmd: tuple[str, int, int, int],
) -> list[float]:
    """Seconds per all-reduce after one warm-up; every result is checked against the sum."""
    method, nbytes, iters, round0 = cmd
    base = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(nbytes))
    mine, want = base * (rank + 1), base * (world * (world + 1) / 2)
    times = []
    for i in range(iters + 1):
        flat = mine.clone()
        if pool is not None:
            pool.begin_round(round0 + i)
        dist.barrier()
        start = time.perf_counter()
        total = reduce(flat, round0 + i)
        elapsed = time.perf_counter() - start
        if not torch.allclose(total, want, rtol=1e-5, atol=1e-4):
            worst = (total - want).abs().max().item()
            raise ValueError(f"{method} all-reduce of {nbytes} B is off by up to {worst}")
        if i:
            times.append(elapsed)
    return times


def reduce_worker(ctrl: Connection, rank: int, world: int, gloo_port: int, keys_root: str) -> None:
    """Child: one ring member with the real worker transport, plain and with CURVE (one
    context each, as two separate workers would have), and a gloo process group."""
    keys = _worker_keys(keys_root, _device(rank))
    ctxs: dict[str, zmq.Context[Any]] = {OURS: zmq.Context(), CURVE: zmq.Context()}
    pool, rx = _start_receiver(ctxs[OURS])
    curve_pool, curve_rx = _start_receiver(ctxs[CURVE], keys)
    ctrl.send(("ok", {OURS: rx.endpoint, CURVE: curve_rx.endpoint}))
    out = Dispatcher(ctxs[OURS], _device(rank))
    curve_out = Dispatcher(ctxs[CURVE], _device(rank), keys=keys)
    peers = _next_cmd(ctrl)
    for method, dispatcher in ((OURS, out), (CURVE, curve_out)):
        dispatcher.start()
        dispatcher.set_peers(peers[method])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOCALHOST}:{gloo_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S),
    )
    ctrl.send(("ok", None))
    methods = {
        OURS: (_ours_allreduce(rank, world, out, pool), pool),
        CURVE: (_ours_allreduce(rank, world, curve_out, curve_pool), curve_pool),
        GLOO: (_gloo_allreduce, None),
    }

    def handle(cmd: tuple[str, int, int, int]) -> list[float]:
        reduce, its_pool = methods[cmd[0]]
        times = _time_allreduce(reduce, its_pool, rank, world, cmd)
        for dispatcher in (out, curve_out):
            if dispatcher.error is not None:
                raise RuntimeError(f"dispatcher failed: {dispatcher.error}")
        return times

    try:
        _serve(ctrl, handle)
    finally:
        dist.destroy_process_group()
        out.close()
        curve_out.close()
        _stop_receivers(rx, curve_rx)


# --- parent side ------------------------------------------------------------------


class Children:
    """Child processes, each with a control pipe; all stopped, then killed, on exit.

    They fork from a server that has imported torch already, so starting one is quick.
    """

    def __init__(self, deadline_s: int) -> None:
        self.deadline_s = deadline_s
        self.procs: list[Any] = []
        self.conns: list[Connection] = []

    def start(self, body: Callable[..., None], *args: Any) -> Connection:
        mine, theirs = _MP.Pipe()
        proc = _MP.Process(
            target=_child_entry, args=(body, theirs, self.deadline_s, *args), daemon=True
        )
        proc.start()
        theirs.close()
        self.procs.append(proc)
        self.conns.append(mine)
        return mine

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=3)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def reply(conn: Connection, timeout_s: float = STEP_TIMEOUT_S) -> Any:
    """The child's answer to the last command; its traceback raised here if it failed."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"child gave no answer in {timeout_s:.0f} s")
    try:
        status, value = conn.recv()
    except EOFError as exc:
        raise RuntimeError("child died without an answer") from exc
    if status == "err":
        raise RuntimeError(f"child failed:\n{value}")
    return value


@dataclass
class StreamPair:
    """Control pipes of the sender and receiver children."""

    sender: Connection
    receiver: Connection

    def stream(self, method: str, nbytes: int, count: int, round_no: int) -> float:
        """Seconds to stream `count` messages and get the receiver's acknowledgement."""
        cmd = (method, nbytes, count, round_no)
        self.receiver.send(cmd)
        self.sender.send(cmd)
        elapsed = float(reply(self.sender))
        reply(self.receiver)
        return elapsed


def _start_pair(kids: Children, keys_root: str) -> StreamPair:
    ack_rx, ack_tx = _MP.Pipe()
    receiver = kids.start(stream_receiver, ack_rx, keys_root)
    sender = kids.start(stream_sender, ack_tx, keys_root)
    ack_rx.close()
    ack_tx.close()
    sender.send(reply(receiver))
    reply(sender)
    return StreamPair(sender, receiver)


def _calibrate(pair: StreamPair, method: str, nbytes: int, seconds: float, round_no: int) -> int:
    """Messages that take about `seconds` (the probe also warms up the connection)."""
    probe = max(4, min(4000, (64 * MiB) // nbytes))
    elapsed = pair.stream(method, nbytes, probe, round_no)
    return max(4, min(200_000, round(probe * seconds / elapsed)))


def _alternating(rep: int, methods: tuple[str, ...]) -> tuple[str, ...]:
    """`methods` in order on even repeats, reversed on odd ones, so that every pair
    runs both ways round equally often."""
    return methods if rep % 2 == 0 else methods[::-1]


def _medians(
    bench: str,
    procs: int,
    unit: str,
    subject: str,
    baseline: str,
    sizes: tuple[int, ...],
    samples: dict[tuple[str, int], list[float]],
) -> list[Row]:
    """One row per size: the median of `subject` against the median of `baseline`."""
    med = {key: statistics.median(values) for key, values in samples.items()}
    return [
        Row(
            bench,
            procs,
            n,
            unit,
            med[subject, n],
            PLAIN if baseline == OURS else baseline,
            med[baseline, n],
            len(samples[subject, n]),
        )
        for n in sizes
    ]


def make_key_set(root: Path, world: int) -> str:
    """A key set with a worker pair for the stream pair and each ring member; its root."""
    create_key_set(root, workers=[SENDER, RECEIVER, *(_device(r) for r in range(world))])
    return str(root)


def measure_throughput(cfg: Config, keys_root: str) -> list[Row]:
    """MB/s of ours and raw TCP per message size, and of ours with CURVE at
    `cfg.curve_sizes`; medians over interleaved repeats. The plain samples serve
    both comparisons, measured in the same alternation as the other two."""
    rounds = itertools.count(1)
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)

    def methods(n: int) -> tuple[str, ...]:
        return (OURS, RAW, CURVE) if n in cfg.curve_sizes else (OURS, RAW)

    with Children(cfg.child_deadline_s) as kids:
        pair = _start_pair(kids, keys_root)
        counts = {
            (m, n): _calibrate(pair, m, n, cfg.stream_s, next(rounds))
            for n in cfg.sizes
            for m in methods(n)
        }
        for rep in range(cfg.stream_repeats):
            for n in cfg.sizes:
                for m in _alternating(rep, methods(n)):
                    elapsed = pair.stream(m, n, counts[m, n], next(rounds))
                    samples[m, n].append(counts[m, n] * n / elapsed / 1e6)
    curve_sizes = tuple(n for n in cfg.sizes if n in cfg.curve_sizes)
    return [
        *_medians("throughput", 2, "MB/s", OURS, RAW, cfg.sizes, samples),
        *_medians("throughput-curve", 2, "MB/s", CURVE, OURS, curve_sizes, samples),
    ]


def measure_allreduce(cfg: Config, world: int, keys_root: str) -> list[Row]:
    """Seconds per all-reduce of ours, ours with CURVE and gloo on `world` processes
    (max over ranks), interleaved in the same children."""
    round0 = 1
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    with Children(cfg.child_deadline_s) as kids:
        port = free_port()
        conns = [kids.start(reduce_worker, rank, world, port, keys_root) for rank in range(world)]
        endpoints = [reply(conn) for conn in conns]
        peers = {
            m: {_device(rank): ends[m] for rank, ends in enumerate(endpoints)}
            for m in (OURS, CURVE)
        }
        for conn in conns:
            conn.send(peers)
        for conn in conns:
            reply(conn)
        for rep in range(cfg.reduce_repeats):
            for n in cfg.reduce_sizes:
                for m in _alternating(rep, (OURS, GLOO, CURVE)):
                    for conn in conns:
                        conn.send((m, n, cfg.reduce_iters, round0))
                    per_rank = [reply(conn) for conn in conns]
                    samples[m, n].extend(max(ts) for ts in zip(*per_rank, strict=True))
                    round0 += cfg.reduce_iters + 1
    return [
        *_medians("allreduce", world, "s", OURS, GLOO, cfg.reduce_sizes, samples),
        *_medians("allreduce-curve", world, "s", CURVE, OURS, cfg.reduce_sizes, samples),
    ]


# --- report -----------------------------------------------------------------------


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _value(x: float, unit: str) -> str:
    return f"{x:,.0f} MB/s" if unit == "MB/s" else f"{x * 1e3:,.1f} ms"


def _met(row: Row) -> str:
    return "-" if row.met is None else ("yes" if row.met else "NO")


BENCH_LABELS = {
    "throughput": "stream",
    "allreduce": "all-reduce",
    "throughput-curve": "stream CURVE",
    "allreduce-curve": "all-reduce CURVE",
}


def _cells(row: Row) -> list[str]:
    return [
        BENCH_LABELS[row.bench],
        str(row.procs),
        size_label(row.nbytes),
        _value(row.ours, row.unit),
        row.baseline,
        _value(row.base, row.unit),
        f"{row.ratio:.2f}",
        row.target,
        _met(row),
        str(row.samples),
    ]


HEADERS = ("bench", "procs", "size", "ours", "vs", "baseline", "ratio", "target", "met", "n")


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Asteroid-Edge transport, loopback (medians; ratio = ours / baseline)")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("bench", "vs") else "right")
    for row in rows:
        cells = _cells(row)
        style = {"yes": "green", "NO": "bold red"}.get(cells[8], "default")
        table.add_row(*cells[:8], f"[{style}]{cells[8]}[/]", cells[9])
    Console(width=None if sys.stdout.isatty() else 120).print(table)


def _machine() -> str:
    return (
        f"nproc {len(os.sched_getaffinity(0))}, {platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, pyzmq {zmq.__version__}, "
        f"libzmq {zmq.zmq_version()}, load average {os.getloadavg()[0]:.1f} at the end "
        "(other work on the machine skews every ratio)"
    )


def _curve_cost(rows: list[Row]) -> list[str]:
    """The CURVE rows as one number each: time with encryption over time without."""
    lines = []
    for r in rows:
        if r.curve:
            what = "stream" if r.unit == "MB/s" else f"ring all-reduce, {r.procs} procs"
            lines.append(f"- {what}, {size_label(r.nbytes)}: x{r.time_ratio:.2f}")
    if not lines:
        return []
    return [
        "## CURVE cost (time with CURVE / time without, same processes, alternating)",
        "",
        *lines,
        "",
    ]


def write_markdown(path: Path, rows: list[Row], command: str, cfg: Config) -> None:
    lines = [
        "# Transport benchmark",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {_machine()}",
        f"- medians over interleaved repeats; throughput: {cfg.stream_repeats} repeats of "
        f"~{cfg.stream_s} s, ratio ours/raw; all-reduce: {cfg.reduce_repeats} x "
        f"{cfg.reduce_iters} timed runs (max over ranks), ratio ours/gloo",
        "- ours: `ReduceChunk` + tensor frame via `Dispatcher` -> `Receiver` -> "
        "`TaskPool.take_chunk`; raw TCP: 8-byte length prefix + body by `sendmsg`, "
        "`recv_into` a fresh tensor per message (what the codec hands the pool)",
        f"- CURVE rows: ours+CURVE against ours plain (`{PLAIN}`) in the same children, "
        "each data-plane socket a CURVE client or server with worker keys of a key set "
        "made per run (ZAP handler admitting the set's worker keys); stream at "
        f"{', '.join(size_label(n) for n in cfg.curve_sizes)}, all-reduce at every size; "
        "ratio = CURVE / plain in the row's unit",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
        *("| " + " | ".join(_cells(row)) + " |" for row in rows),
        "",
        *_curve_cost(rows),
    ]
    path.write_text("\n".join(lines))


def _record(r: Row) -> dict[str, object]:
    return {
        "bench": r.bench,
        "procs": r.procs,
        "size_bytes": r.nbytes,
        "unit": r.unit,
        "ours": f"{r.ours:.6g}",
        "baseline": r.baseline,
        "baseline_value": f"{r.base:.6g}",
        "ratio": f"{r.ratio:.4f}",
        "target": r.target,
        "met": _met(r),
        "samples": r.samples,
    }


def write_csv(path: Path, rows: list[Row]) -> None:
    records = [_record(r) for r in rows]
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=list(records[0]))
        out.writeheader()
        out.writerows(records)


def write_plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    stream = [r for r in rows if r.bench == "throughput"]
    x = [r.nbytes for r in stream]
    left.plot(x, [r.ours for r in stream], "o-", label="ours (Dispatcher → Receiver)")
    left.plot(x, [r.base for r in stream], "s--", label="raw TCP")
    left.set(
        xscale="log",
        xlabel="message size",
        ylabel="MB/s",
        title="worker-to-worker stream, loopback",
    )
    for world in sorted({r.procs for r in rows if r.bench == "allreduce"}):
        red = [r for r in rows if r.bench == "allreduce" and r.procs == world]
        x = [r.nbytes for r in red]
        right.plot(x, [r.ours * 1e3 for r in red], "o-", label=f"ours ring, {world} procs")
        right.plot(x, [r.base * 1e3 for r in red], "s--", label=f"gloo, {world} procs")
    right.set(
        xscale="log",
        yscale="log",
        xlabel="tensor size (float32)",
        ylabel="ms per all-reduce",
        title="all-reduce (sum), loopback",
    )
    for ax, sizes in ((left, stream), (right, [r for r in rows if r.bench == "allreduce"])):
        ticks = sorted({r.nbytes for r in sizes})
        ax.set_xticks(ticks, [size_label(n) for n in ticks], minor=False)
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_curve_plot(path: Path, rows: list[Row]) -> None:
    """Plain against CURVE side by side: stream MB/s and all-reduce ms, bars per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("throughput-curve", "MB/s", 1.0, "worker-to-worker stream, loopback"),
        ("allreduce-curve", "ms per all-reduce", 1e3, "ring all-reduce (ours), loopback"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (bench, ylabel, scale, title) in zip(axes, panels, strict=True):
        red = [r for r in rows if r.bench == bench]
        x = range(len(red))
        width = 0.38
        plain = ax.bar([i - width / 2 for i in x], [r.base * scale for r in red], width)
        curve = ax.bar([i + width / 2 for i in x], [r.ours * scale for r in red], width)
        plain.set_label("plain")
        curve.set_label("CURVE")
        ax.bar_label(curve, labels=[f"x{r.time_ratio:.2f} time" for r in red], fontsize=8)
        labels = [
            size_label(r.nbytes) if r.unit == "MB/s" else f"{size_label(r.nbytes)}\n{r.procs} procs"
            for r in red
        ]
        ax.set_xticks(list(x), labels)
        ax.set(ylabel=ylabel, title=title)
        ax.margins(y=0.12)  # room for the labels above the bars
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle("cost of CURVE on the data plane (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------


def run(cfg: Config, keys_root: str) -> Iterator[Row]:
    yield from measure_throughput(cfg, keys_root)
    for world in cfg.reduce_procs:
        yield from measure_allreduce(cfg, world, keys_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/transport"))
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (< 60 s)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    command = " ".join(["python -m tests.bench.bench_transport", *(argv or sys.argv[1:])])
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
            rows = list(run(cfg, make_key_set(Path(tmp), max(cfg.reduce_procs))))
    except (RuntimeError, TimeoutError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    print_table(rows)
    write_markdown(args.out / "transport.md", rows, command, cfg)
    write_csv(args.out / "transport.csv", rows)
    write_plot(args.out / "transport.png", rows)
    write_curve_plot(args.out / "curve.png", rows)
    print(
        f"wrote {args.out}/transport.{{md,csv,png}} and curve.png "
        f"in {time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
