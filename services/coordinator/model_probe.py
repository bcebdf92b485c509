"""Build a job's model in a child process with a memory ceiling and a deadline.

A submitted job names a model; checking it means building it, and building runs
allow-listed user code and allocates whatever the options ask for. Done inside the
coordinator's message loop, one spec could freeze or OOM-kill the coordinator. Here a
child process builds it under ``RLIMIT_AS`` (and first in line for the OOM killer),
answers plain numbers as JSON, and is killed at the deadline: a hostile or huge spec
costs the coordinator a refused job, never its memory.

The children fork from a small server process (``python -m
services.coordinator.model_probe``) that imports torch and the zoo once, so a check
costs a fork and the build, not an interpreter start; the server is single-threaded,
so forking it is safe where forking the coordinator (ZeroMQ and torch threads) is not.
It reads one JSON request per line on stdin and answers one line on stdout, and it
exits when its parent closes stdin (or dies).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.init_weights import WeightsMismatch, mismatch, state_shapes
from common.settings import CoordinatorSettings
from common.zoo import ModelSpec, build_model
from common.zoo.custom import check_model_source

__all__ = ["ModelFacts", "ProbeLimits", "probe_limits", "probe_model", "start_probe_server"]

_MAX_REPLY = 1 << 16
_MAX_ERROR = 4000
_START_S = 180.0
"""Longest wait for the server's imports (torch on a loaded board takes a while)."""
_MARGIN_S = 10.0
_READY = b"ready\n"


@dataclass(frozen=True)
class ProbeLimits:
    """How much memory and time one model check may take.

    Attributes:
        memory_bytes: Address space the build may add to the child's (its ``RLIMIT_AS``
            above what the server's imports already map).
        timeout_s: Longest build; the child is killed after it.

    """

    memory_bytes: int = 6 << 30
    timeout_s: float = 60.0


@dataclass(frozen=True)
class ModelFacts:
    """What the check learnt about the model: plain numbers, no tensor crosses back.

    Attributes:
        layers: Placeable layers (units the planner assigns to stages).
        parameters: Parameters over all layers.
        parameter_bytes: Bytes those parameters take.

    """

    layers: int
    parameters: int
    parameter_bytes: int


def probe_limits(settings: CoordinatorSettings) -> ProbeLimits:
    """The limits the coordinator's settings give its model checks."""
    return ProbeLimits(settings.model_check_memory_mb << 20, settings.model_check_timeout_s)


# --- the caller's side -----------------------------------------------------------------


class _Server:
    """The server process and the bytes it has sent that no request has consumed yet."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", __name__]
        # run from where this package is installed: `-m` puts the working folder first on
        # the path, where a folder of the user's own named `services` would shadow ours
        home = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=home)
        if self.proc.stdin is None or self.proc.stdout is None:  # never with PIPE
            raise ConfigError("the model check process has no pipes")
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.buffer = b""
        self.ready = False

    def line(self, deadline: float) -> bytes | None:
        """The next line it writes, or None at `deadline` or when it has exited."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.stdout, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or len(self.buffer) > _MAX_REPLY or not sel.select(left):
                    return None
                chunk = os.read(self.stdout.fileno(), _MAX_REPLY)
                if not chunk:
                    return None
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line + b"\n"

    def ask(self, request: bytes, wait_s: float) -> bytes | None:
        """Send one request line and return the answer line, or None if none came."""
        if not self.ready:
            if self.line(time.monotonic() + _START_S) != _READY:
                return None
            self.ready = True
        try:
            self.stdin.write(request)
            self.stdin.flush()
        except OSError:
            return None
        return self.line(time.monotonic() + wait_s)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.stdin.close()
        self.stdout.close()


_lock = threading.Lock()
_server: _Server | None = None


def start_probe_server() -> None:
    """Start the server now, so that its imports overlap the caller's own start-up."""
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()


def probe_model(
    spec: ModelSpec,
    seed: int,
    allowed_modules: Collection[str] = (),
    limits: ProbeLimits = ProbeLimits(),
    init_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> ModelFacts:
    """Build `spec` in a child process under `limits` and return its sizes.

    The allow-list is checked here first, so a module outside it is refused without
    a process, an import or a call. With `init_shapes` (an ``init_from`` file's
    header), the child also compares them with the model's state dict, so the
    model is built once for both checks.

    Raises:
        ConfigError: The model is refused (allow-list, options, user code), needs more
            memory than `limits` allows, takes longer, or its process dies.
        WeightsMismatch: `init_shapes` are not the names and shapes of its state dict.

    """
    global _server
    check_model_source(spec.name, allowed_modules)
    request = {
        "spec": spec.model_dump(mode="json"),
        "seed": seed,
        "allowed": list(allowed_modules),
        "path": list(sys.path),  # user modules resolve as they would in the caller
        "memory_bytes": limits.memory_bytes,
        "timeout_s": limits.timeout_s,
        "init": None if init_shapes is None else {k: list(v) for k, v in init_shapes.items()},
    }
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        answer = _server.ask(json.dumps(request).encode() + b"\n", limits.timeout_s + _MARGIN_S)
        if answer is None:  # a wedged or dead server is replaced at the next check
            _server.close()
            _server = None
            raise ConfigError(f"model {spec.name!r}: the model check gave no answer; refused")
    return _facts(spec, answer)


def _facts(spec: ModelSpec, raw: bytes) -> ModelFacts:
    """Parse an answer line; anything unexpected is the model's fault."""
    try:
        answer = json.loads(raw)
        if answer.get("error") is not None:
            raise ConfigError(str(answer["error"]))
        if answer.get("init") is not None:
            raise WeightsMismatch(str(answer["init"]))
        facts = ModelFacts(**answer["facts"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"model {spec.name!r}: its check answered nonsense: {exc!r}") from exc
    if not all(isinstance(v, int) and v >= 0 for v in asdict(facts).values()):
        raise ConfigError(f"model {spec.name!r}: its check answered nonsense: {facts}")
    return facts


# --- the server and its children -------------------------------------------------------


def _limit_memory(extra_bytes: int) -> None:
    """Cap the address space at what is mapped now plus `extra_bytes`; OOM-kill us first."""
    with open("/proc/self/status", encoding="ascii") as status:
        mapped = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
    limit = mapped + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as adj:
            adj.write("1000")
    except OSError:  # a locked-down /proc: the rlimit still holds
        pass


def _build(request: dict[str, Any]) -> dict[str, Any]:
    """Build the requested model under its memory limit; the answer as a JSON object."""
    name = request["spec"].get("name")
    memory = int(request["memory_bytes"])
    try:
        sys.path[:] = [str(p) for p in request["path"]]
        importlib.invalidate_caches()
        _limit_memory(memory)
        model = build_model(
            ModelSpec.model_validate(request["spec"]), request["seed"], request["allowed"]
        )
        params = [p for layer in model.layers for p in layer.parameters()]
        facts = ModelFacts(
            layers=len(model.layers),
            parameters=sum(p.numel() for p in params),
            parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        )
        init = request.get("init")
        problem = None
        if init is not None:
            file = {str(k): tuple(int(d) for d in v) for k, v in init.items()}
            problem = mismatch(file, state_shapes(model.full()))
        return {"facts": asdict(facts), "init": problem}
    except ConfigError as exc:  # it may quote what user code raised: keep the answer short
        return {"error": str(exc)[:_MAX_ERROR]}
    except (MemoryError, RuntimeError) as exc:  # torch's failed allocation is a RuntimeError
        return {
            "error": f"model {name!r} cannot be built within the {memory >> 20} MiB a "
            f"check may use: {str(exc)[:300]}"
        }
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # report, never raise
        return {"error": f"model {name!r} cannot be built: {exc!r}"[:_MAX_ERROR]}


def _child(request: dict[str, Any], out: int) -> None:
    """In the forked child: build, write the answer to `out`, exit without cleanup."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # user code reads no request and writes into no answer
    os.dup2(devnull, 1)
    answer = _build(request)
    os.write(out, json.dumps(answer).encode()[:_MAX_REPLY])
    os._exit(0)  # skips atexit hooks user code may have registered


def _run_one(request: dict[str, Any]) -> dict[str, Any]:
    """Fork a child for one request, wait for it at most its timeout, reap it."""
    name = request["spec"].get("name")
    timeout_s = float(request["timeout_s"])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child ends in os._exit
        os.close(read_end)
        _child(request, write_end)
    os.close(write_end)
    data = b""
    timed_out = False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(read_end, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and sel.select(left):
            chunk = os.read(read_end, _MAX_REPLY)
            if not chunk:
                break
            data += chunk
        else:  # the deadline passed before the child closed its end
            os.kill(pid, signal.SIGKILL)
            timed_out = True
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"error": f"model {name!r}: building it took longer than {timeout_s:g} s"}
    try:
        answer: dict[str, Any] = json.loads(data)
        return answer
    except ValueError:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "no answer"
        return {
            "error": f"model {name!r}: the process building it died ({how}); it likely "
            f"needs more than the {int(request['memory_bytes']) >> 20} MiB a check may use"
        }


def _serve() -> None:
    """Answer requests on stdin until it closes."""
    import torch

    torch.set_num_threads(1)  # each thread's stack and arena would eat a child's limit
    out = sys.stdout.buffer
    out.write(_READY)
    out.flush()
    for line in sys.stdin.buffer:
        answer = _run_one(json.loads(line))
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
