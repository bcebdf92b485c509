"""`asteroid join tcp://HOST:PORT`: this device's worker and profiler, as one command.

A device joins a cluster knowing only the coordinator's address and its key
set: the worker and the profiler each ask the coordinator where Redis is, and
log in with the key set's passwords (`common.locate`). Both run as children,
started by their installed commands (`common.entry_points`); Ctrl-C or SIGTERM stops
both (bounded), and a child that dies is reported and the other stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, get_args

import typer

from common.entry_points import service_command
from common.errors import ConfigError
from common.exit_codes import ExitCode
from services.cli.failure import fail

__all__ = ["Outcome", "child_commands", "join", "outcome"]

ADDRESS = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
"""What `join` takes as the coordinator's address."""
STOP_S = 15.0
"""Longest the children get to stop after SIGTERM before they are killed."""
POLL_S = 0.2
"""How often the children are looked at."""
_PR_SET_PDEATHSIG = 1


def check_address(address: str) -> str:
    """`address` if it is tcp://HOST:PORT with a port in range, else a one-line error."""
    match = ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match[2]) < 65536:
        raise typer.BadParameter(
            f"{address!r} is not a coordinator address like tcp://192.168.1.10:5555"
        )
    return address


def check_accelerator(value: str | None) -> str | None:
    """`--accelerator`: one of the values the worker and the profiler take, else a usage error."""
    from common.settings import AcceleratorChoice  # pydantic-settings: when a command runs

    choices = get_args(AcceleratorChoice)
    if value is not None and value not in choices:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
    return value


def child_commands(
    start: Callable[[str], list[str]],
    coordinator: str,
    keys: Path | None,
    device: str | None,
    memory_budget: str | None,
    threads: int | None,
    profiler: bool,
    accelerator: str | None = None,
) -> dict[str, list[str]]:
    """The worker's and (with `profiler`) the profiler's command lines, by name.

    `start(service)` is how a service is started (`common.entry_points`). Both
    get the coordinator and the key set, and no Redis URL: each learns Redis
    from the coordinator. They share the memory budget, so the profiler
    measures the device the worker describes, and the accelerator, so it
    profiles the processor the worker computes on.
    """
    common = ["--coordinator", coordinator]
    common += ["--keys", str(keys)] if keys is not None else []
    budget = ["--memory-budget", memory_budget] if memory_budget else []
    budget += ["--accelerator", accelerator] if accelerator else []
    worker = [*start("worker"), *common, *budget]
    worker += ["--device", device] if device else []
    worker += ["--threads", str(threads)] if threads else []
    out = {"worker": worker}
    if profiler:
        out["profiler"] = [*start("profiler"), "--serve", *common, *budget]
    return out


@dataclass(frozen=True)
class Outcome:
    """What `join` says and exits with once child `name` ended with `code`."""

    message: str
    exit_code: int


def outcome(name: str, code: int) -> Outcome:
    """The report of child `name` ending by itself with return code `code`.

    A worker that exits cleanly was told to by the coordinator (its shutdown):
    `join` ends cleanly too. Anything else ends `join` with the child's own
    code, or FAILED when a signal killed it.
    """
    if name == "worker" and code == 0:
        return Outcome("the worker exited: the coordinator told it to stop", int(ExitCode.OK))
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return Outcome(
        f"the {name} {how}; stopping the rest", code if code > 0 else int(ExitCode.FAILED)
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Ask the kernel to SIGTERM the child if `join` itself is killed outright."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every live child's group, wait up to `STOP_S` in all, then SIGKILL the rest."""
    for proc in procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            typer.echo(f"join: the {name} did not stop within {STOP_S:g} s; killing it", err=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def join(
    coordinator: Annotated[
        str,
        typer.Argument(
            help="The coordinator's control address.",
            metavar="tcp://HOST:PORT",
            callback=check_address,
        ),
    ],
    keys: Annotated[
        Path | None,
        typer.Option(
            help="Key set holding this device's worker and profiler keys (and Redis "
            "passwords, in redis/); default ASTEROID_KEYS.",
            envvar="ASTEROID_KEYS",
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="Device name (default: the key set's worker key, else the host)."),
    ] = None,
    memory_budget: Annotated[
        str | None, typer.Option(help="Bytes training may use on this device (default: all).")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Torch threads (default: every core).")
    ] = None,
    profiler: Annotated[
        bool,
        typer.Option(
            "--profiler/--no-profiler",
            help="Also run this device's profiler (one per kind of device is enough).",
        ),
    ] = True,
    accelerator: Annotated[
        str | None,
        typer.Option(
            help="auto (a CUDA GPU when torch sees one), cpu or cuda, for the worker and "
            "the profiler alike (default: auto, or ASTEROID_ACCELERATOR).",
            callback=check_accelerator,
        ),
    ] = None,
) -> None:
    """Join a cluster: run this device's worker and profiler until Ctrl-C or SIGTERM.

    Needs only the coordinator's address and the key set: Redis's place comes
    from the coordinator. Exit codes: 0 the coordinator shut the worker down,
    130 stopped, else the code of the child that died.
    """
    if keys is not None and not keys.is_dir():  # before any child starts and says it too
        raise fail(
            ConfigError(f"--keys {keys}: no such key set folder (made by `asteroid keys init`)")
        )
    try:
        cmds = child_commands(
            service_command,
            coordinator,
            keys,
            device,
            memory_budget,
            threads,
            profiler,
            accelerator,
        )
    except ConfigError as exc:  # not installed here
        raise fail(exc) from exc
    stopping = threading.Event()
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def on_signal(signum: int, _: object) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = int(ExitCode.INTERRUPTED)
    try:
        for name, cmd in cmds.items():
            procs[name] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches join, which stops them in order
                preexec_fn=_die_with_parent,
            )
            typer.echo(f"join: started the {name} (pid {procs[name].pid})", err=True)
        while not stopping.wait(POLL_S):
            ended = [(n, p.returncode) for n, p in procs.items() if p.poll() is not None]
            if ended:
                result = outcome(*ended[0])
                typer.echo(f"join: {result.message}", err=True)
                code = result.exit_code
                break
        else:
            typer.echo(f"join: stopping the {' and the '.join(procs)}", err=True)
    finally:
        _stop(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise typer.Exit(code)
