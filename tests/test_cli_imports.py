"""The commands that only ask something never import torch (issue 27, friction 8).

torch takes seconds to import (ten on a loaded Raspberry Pi), so `asteroid
--version`, `status`, `cancel`, `drain` and `infer` must not import it, and nor
must the gateway, which only reads and forwards requests. Each case runs the
command in a fresh interpreter against a target that does not answer, with a
watch on the import system that records who imported torch first, so that a
failure names the chain to break.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOBODY = "tcp://127.0.0.1:1"
"""A coordinator address where nothing listens (port 1: refused at once)."""

_PROBE = """
import atexit, json, sys, traceback

report_path, kind, what, *args = sys.argv[1:]
chain = []


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not chain:
            chain.extend(f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1])
        return None


def report():
    with open(report_path, "w") as f:
        json.dump({"torch": "torch" in sys.modules, "chain": chain}, f)


sys.meta_path.insert(0, Watch())
atexit.register(report)
if kind == "answered":  # a coordinator that answers one infer request (logits, no tensors)
    import threading

    import zmq

    from common.codec import Limits, recv_message, send_message
    from common.serving_messages import InferReply

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        if router.poll(60_000):
            _, env = recv_message(router, Limits(), routed=True)
            reply = InferReply(
                serve_id=env.msg.serve_id, request=1, ok=True, tokens=[7], logits=[0.5, 1.5]
            )
            send_message(router, reply, "coordinator", route=env.route)

    threading.Thread(target=answer, daemon=True).start()
    args = [a.replace("COORDINATOR", f"tcp://127.0.0.1:{port}") for a in args]
if kind == "module":
    import importlib

    importlib.import_module(what)
else:
    from services.cli import main

    sys.argv = ["asteroid", *args]
    main(args)
"""

QUICK = ["--timeout", "0.2"]

_BAD_ARGUMENTS = ("No such option", "Missing argument", "Invalid value")
"""Click's words for arguments it refused: the command would not have run at all."""

CASES = {
    "version": ["--version"],
    "status": ["status"],
    "status-unreachable-redis": ["status", "--redis-url", "redis://127.0.0.1:1/0"],
    "cancel": ["cancel", "job-x", "--coordinator", NOBODY, "--reply-timeout", "0.2"],
    "drain": ["drain", "dev-0", "--coordinator", NOBODY, "--reply-timeout", "0.2"],
    "infer-ids": ["infer", "serve-x", "--ids", "5,17,3", "--coordinator", NOBODY, *QUICK],
    "infer-prompt": ["infer", "serve-x", "--prompt", "hi", "--coordinator", NOBODY, *QUICK],
    "infer-help": ["infer", "--help"],
}


def _run(tmp_path: Path, kind: str, what: str, args: list[str]) -> tuple[dict[str, object], str]:
    """Run the probe; its report and the command's output (rc and stderr, for failures)."""
    report = tmp_path / "imports.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(report), kind, what, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = f"rc {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}"
    assert report.exists(), f"the probe wrote no report\n{output}"
    assert "Traceback" not in proc.stderr, output
    return json.loads(report.read_text()), output


def _chain(report: dict[str, object]) -> str:
    frames = report["chain"]
    assert isinstance(frames, list)
    ours = [str(f).removeprefix(f"{ROOT}/") for f in frames if str(f).startswith(str(ROOT))]
    return "\n  <- ".join(reversed(ours))


@pytest.mark.parametrize("args", list(CASES.values()), ids=list(CASES))
def test_a_command_that_only_asks_does_not_import_torch(tmp_path: Path, args: list[str]) -> None:
    report, output = _run(tmp_path, "cli", "asteroid", args)
    command = " ".join(args)
    assert report["torch"] is False, f"asteroid {command} imported torch:\n  {_chain(report)}"
    assert not any(words in output for words in _BAD_ARGUMENTS), f"refused arguments\n{output}"


def test_infer_with_an_answer_does_not_import_torch(tmp_path: Path) -> None:
    """The answer's logits come as numbers in the message, so reading it needs no torch."""
    args = ["infer", "serve-x", "--ids", "5,17,3", "--coordinator", "COORDINATOR", *QUICK]
    report, output = _run(tmp_path, "answered", "asteroid", [*args[:-1], "30"])
    assert "argmax 1" in output, f"the answer was not printed\n{output}"
    assert report["torch"] is False, f"asteroid infer imported torch:\n  {_chain(report)}"


def test_status_of_an_empty_cluster_does_not_import_torch(tmp_path: Path, redis_url: str) -> None:
    cluster = f"imports-{uuid.uuid4().hex[:8]}"
    args = ["status", "--redis-url", redis_url, "--cluster", cluster]
    report, _ = _run(tmp_path, "cli", "asteroid", args)
    assert report["torch"] is False, f"asteroid status imported torch:\n  {_chain(report)}"


@pytest.mark.parametrize("module", ["services.gateway.main", "services.cli.client"])
def test_a_module_that_only_forwards_does_not_import_torch(tmp_path: Path, module: str) -> None:
    report, _ = _run(tmp_path, "module", module, [])
    assert report["torch"] is False, f"import {module} imported torch:\n  {_chain(report)}"


def test_the_probe_sees_torch_when_it_is_imported(tmp_path: Path) -> None:
    """The watch is not blind: a module that does import torch is reported, with its chain."""
    report, _ = _run(tmp_path, "module", "common.zoo._registry", [])
    assert report["torch"] is True
    assert "common/zoo/_registry.py" in _chain(report)


LAZY = (
    "services.deploy",
    "services.planner",
    "services.cli.doctor.checks",
    "zmq",
    "yaml",
    "redis",
    "structlog",
    "pydantic_settings",
)
"""What only some commands use (deploy's ssh and YAML, the planners, doctor's probes,
ZeroMQ, Redis, the services' logging and settings): each command imports it when it
runs, not every `asteroid` start."""


def test_the_cli_starts_without_what_only_some_commands_use() -> None:
    code = (
        "import json, sys, services.cli; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {LAZY!r} "
        f"or any(m == p or m.startswith(p + '.') for p in {LAZY!r}))))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [], "import services.cli imported these"


def test_plan_help_names_every_planner_of_the_registry() -> None:
    """`asteroid plan --help` lists the planners without importing them: the two lists agree."""
    from services.cli.plan import PLANNER_NAMES
    from services.planner.registry import PLANNERS

    assert list(PLANNER_NAMES) == sorted(PLANNERS)
