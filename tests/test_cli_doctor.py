"""`asteroid doctor`'s pure parts: the report's table, JSON and exit code, and each verdict.

How monitor events read, what each coordinator outcome says and how to fix
it, the clock's tolerance, Redis's errors, the extras and a port: each
without a cluster (a port is checked against a real socket holding it). The
checks against real processes are in tests/integration/test_doctor.py.
"""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import torch
import zmq
from rich.console import Console

from common.curve import CurveKeys, create_key_set
from common.errors import ConfigError
from common.exit_codes import ExitCode
from services.cli.doctor.checks import pick_keys
from services.cli.doctor.clock import CLOCK_TOLERANCE_S, clock_check
from services.cli.doctor.coordinator import Visit, coordinator_checks, reach_of
from services.cli.doctor.host import NVIDIA_DRIVER, TEGRA_RELEASE, accelerator_check, extras_check
from services.cli.doctor.ports import port_check
from services.cli.doctor.report import Check, as_json, exit_code, render
from services.cli.doctor.store import Reply, redis_check

HEALTHY = [
    Check("machine", "ok", "aarch64, Linux 6.1, Python 3.10.12", data={"arch": "aarch64"}),
    Check("extras", "note", "installed: none", "pip install 'asteroid-edge[plots]'"),
    Check("clock", "skipped", "not known"),
]
SICK = [*HEALTHY, Check("redis", "problem", "no answer at redis://h:6379/0", "start Redis")]


def _rendered(checks: list[Check]) -> str:
    out = io.StringIO()
    render(checks, Console(file=out, width=200, color_system=None))
    return out.getvalue()


# --- the report ------------------------------------------------------------------------


def test_only_a_problem_makes_the_exit_code_device_failed() -> None:
    assert exit_code(HEALTHY) == ExitCode.OK == 0
    assert exit_code(SICK) == ExitCode.DEVICE_FAILED == 5
    assert exit_code([]) == ExitCode.OK


def test_the_table_has_a_row_per_check_then_each_fix_then_the_verdict() -> None:
    text = _rendered(SICK)
    lines = text.splitlines()
    rows = [line.split()[:2] for line in lines[1:5]]
    assert rows == [
        ["machine", "ok"],
        ["extras", "note"],
        ["clock", "skipped"],
        ["redis", "PROBLEM"],
    ]
    # the extra's brackets are text, not markup
    assert "fix: pip install 'asteroid-edge[plots]'" in text
    assert "PROBLEM redis: no answer at redis://h:6379/0\n  fix: start Redis" in text
    assert lines[-1] == "1 problem (exit code 5)"
    assert _rendered(HEALTHY).splitlines()[-1] == "healthy: this device is ready to join"


def test_a_peers_text_cannot_drive_the_terminal_or_the_markup() -> None:
    text = _rendered([Check("coordinator", "problem", "refused: \x1b[2J[red]x[/red]", "a\nb")])
    assert "\x1b" not in text
    assert "\\x1b[2J[red]x[/red]" in text
    assert "fix: a\\x0ab" in text  # one line


def test_the_json_holds_every_check_in_order_and_the_verdict() -> None:
    report = json.loads(json.dumps(as_json(SICK)))  # JSON all the way down
    assert report["healthy"] is False
    assert report["problems"] == 1
    assert [c["name"] for c in report["checks"]] == ["machine", "extras", "clock", "redis"]
    assert report["checks"][0] == {
        "name": "machine",
        "status": "ok",
        "summary": "aarch64, Linux 6.1, Python 3.10.12",
        "fix": "",
        "data": {"arch": "aarch64"},
    }
    assert as_json(HEALTHY)["healthy"] is True


# --- the coordinator -----------------------------------------------------------------

E = zmq


@pytest.mark.parametrize(
    ("events", "answered", "reach"),
    [
        ([E.EVENT_CONNECTED, E.EVENT_HANDSHAKE_SUCCEEDED], True, "answered"),
        ([E.EVENT_CONNECTED, E.EVENT_HANDSHAKE_SUCCEEDED], False, "busy"),
        ([E.EVENT_CONNECTED, E.EVENT_HANDSHAKE_FAILED_AUTH], False, "key_refused"),
        ([E.EVENT_CONNECTED, E.EVENT_HANDSHAKE_FAILED_NO_DETAIL], False, "wrong_server_key"),
        ([E.EVENT_CONNECTED, E.EVENT_HANDSHAKE_FAILED_PROTOCOL], False, "mechanism"),
        ([E.EVENT_CONNECTED], False, "not_zmq"),
        ([E.EVENT_CONNECT_RETRIED], False, "nothing"),
        ([], False, "silent"),
    ],
)
def test_monitor_events_tell_how_far_a_connection_got(
    events: list[int], answered: bool, reach: str
) -> None:
    assert reach_of(events, answered) == reach


@pytest.fixture
def worker_keys(tmp_path: Path) -> CurveKeys:
    create_key_set(tmp_path / "keys", workers=["nano-1"])
    return CurveKeys.load(tmp_path / "keys", "worker")


ADDR = "tcp://192.168.1.10:5555"


def _rows(reach: str, keys: CurveKeys | None) -> dict[str, Check]:
    v = Visit(ADDR, reach)  # type: ignore[arg-type]
    return {c.name: c for c in coordinator_checks(v, keys, 2.0)}


def test_a_refused_key_names_the_file_to_copy_to_the_coordinators_host(
    worker_keys: CurveKeys,
) -> None:
    rows = _rows("key_refused", worker_keys)
    assert rows["coordinator"].status == "ok"
    keys = rows["keys"]
    assert keys.status == "problem"
    assert "refused this device's key (worker:nano-1)" in keys.summary
    assert keys.fix.startswith(
        f"scp {worker_keys.root}/workers/nano-1.key 192.168.1.10:KEYS/workers/"
    )


def test_a_wrong_server_key_names_the_coordinators_public_key_to_fetch(
    worker_keys: CurveKeys,
) -> None:
    keys = _rows("wrong_server_key", worker_keys)["keys"]
    assert keys.status == "problem"
    assert "is not this coordinator's" in keys.summary
    want = f"scp 192.168.1.10:KEYS/coordinator/coordinator.key {worker_keys.root}/coordinator/"
    assert keys.fix.startswith(want)


def test_curve_on_one_side_only_says_which_side(worker_keys: CurveKeys) -> None:
    assert "has none" in _rows("mechanism", None)["keys"].summary
    assert "--keys" in _rows("mechanism", None)["keys"].fix
    assert "runs without" in _rows("mechanism", worker_keys)["keys"].summary


@pytest.mark.parametrize(
    ("reach", "says", "fix"),
    [
        ("nothing", "connection refused", "asteroid-coordinator --bind tcp://0.0.0.0:5555"),
        ("silent", "no connection to", "sudo ufw allow 5555/tcp"),
        ("not_zmq", "not a coordinator", "--bind"),
        ("busy", "did not answer within 2 s", "asteroid doctor --timeout 10"),
    ],
)
def test_each_way_the_coordinator_fails_has_its_fix(
    worker_keys: CurveKeys, reach: str, says: str, fix: str
) -> None:
    rows = _rows(reach, worker_keys)
    assert rows["coordinator"].status == "problem"
    assert says in rows["coordinator"].summary
    assert fix in rows["coordinator"].fix
    # only a handshake tells whether the keys match
    assert rows["keys"].status == ("ok" if reach == "busy" else "skipped")


def test_a_failed_handshake_without_keys_is_not_a_coordinator() -> None:
    rows = _rows("wrong_server_key", None)
    assert rows["coordinator"].status == "problem"
    assert "not a coordinator" in rows["coordinator"].summary
    assert rows["keys"].status == "skipped"


def test_an_answer_is_two_healthy_rows(worker_keys: CurveKeys) -> None:
    rows = _rows("answered", worker_keys)
    assert [c.status for c in rows.values()] == ["ok", "ok"]
    assert "worker:nano-1" in rows["keys"].summary


def test_a_device_key_set_gives_its_one_secret_key(tmp_path: Path) -> None:
    create_key_set(tmp_path / "k", workers=["nano-1"], operators=["ann"])
    assert (pick_keys(tmp_path / "k", None).role, pick_keys(tmp_path / "k", None).name) == (
        "worker",
        "nano-1",
    )
    create_key_set(tmp_path / "k", workers=["nano-2"])  # two workers: the coordinator's set
    assert pick_keys(tmp_path / "k", "nano-2").name == "nano-2"
    assert pick_keys(tmp_path / "k", None).role == "operator"  # the one single secret left
    create_key_set(tmp_path / "bare")  # the coordinator's pair only
    with pytest.raises(ConfigError, match="pass --device NAME"):
        pick_keys(tmp_path / "bare", None)


# --- the clock ------------------------------------------------------------------------


def test_the_clock_is_a_problem_only_beyond_the_tolerance_and_its_uncertainty() -> None:
    assert clock_check(0.002, 0.001, "coordinator").status == "ok"
    late = clock_check(-3600.0, 0.002, "coordinator")
    assert late.status == "problem"
    assert "-3600000.0" in late.summary
    assert "timedatectl set-ntp true" in late.fix
    # within the tolerance once half the round trip is allowed for
    assert clock_check(CLOCK_TOLERANCE_S + 0.1, 0.4, "redis").status == "ok"
    assert clock_check(CLOCK_TOLERANCE_S + 0.1, 0.1, "redis").status == "problem"
    unknown = clock_check(None, None, "")
    assert (unknown.status, unknown.data["source"]) == ("skipped", None)
    assert clock_check(0.0, 0.0, "redis").data["source"] == "redis"


# --- Redis ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "says", "fix"),
    [
        (redis.AuthenticationError("WRONGPASS"), "refused the login as worker", "worker.password"),
        (redis.exceptions.NoPermissionError("NOPERM"), "denies PING", "+ping"),
        (redis.TimeoutError("Timeout connecting"), "within 2 s", "systemctl start redis-server"),
        (redis.ConnectionError("Connection refused"), "does not answer", "--redis-url"),
    ],
)
def test_each_redis_failure_has_its_fix(error: Exception, says: str, fix: str) -> None:
    row = redis_check(Reply("redis://worker:***@10.0.0.2:6379/0", error), "worker", 2.0)
    assert row.status == "problem"
    assert says in row.summary
    assert fix in row.fix
    assert redis_check(Reply("redis://h:1/0"), None, 2.0).status == "ok"


# --- extras and ports ----------------------------------------------------------------


def test_missing_extras_are_a_note_with_the_install_command() -> None:
    row = extras_check(lambda module: None if module in ("matplotlib", "sklearn") else object())
    assert row.status == "note"
    assert row.data == {
        "installed": ["dashboard", "data", "gateway", "quickstart", "serve"],
        "missing": ["fl", "plots"],
    }
    assert row.fix == "only if you want them: pip install 'asteroid-edge[fl,plots]'"
    assert extras_check(lambda module: object()).status == "ok"


def test_a_port_someone_listens_on_is_taken_and_a_free_one_is_free() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        taken = port_check("data port", "--data-port", "127.0.0.1", port)
        assert taken.status == "problem"
        assert taken.data["free"] is False
        assert f"ss -ltnp 'sport = :{port}'" in taken.fix
        assert "--data-port N" in taken.fix
    free = port_check("data port", "--data-port", "127.0.0.1", port)
    assert (free.status, free.data["free"]) == ("ok", True)
    assert port_check("link port", "--link-port", "127.0.0.1", 0).status == "ok"


# --- the accelerator ------------------------------------------------------------------

no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a machine torch sees no GPU on"
)


@no_gpu
def test_a_machine_without_a_gpu_trains_on_its_cpu_and_that_is_fine(tmp_path: Path) -> None:
    row = accelerator_check(torch, "auto", tmp_path)
    assert (row.status, row.data) == ("ok", {"kind": "cpu"})


@no_gpu
@pytest.mark.parametrize(
    ("sign", "build", "says", "fix"),
    [
        (TEGRA_RELEASE, None, "this is a Jetson, but torch 2.5.0 is a CPU build", "JetPack"),
        (NVIDIA_DRIVER, None, "an NVIDIA driver, but torch 2.5.0 is a CPU build", "whl/cu124"),
        (NVIDIA_DRIVER, "12.4", "but torch (CUDA 12.4) sees no GPU", "nvidia-smi"),
    ],
)
def test_a_gpu_torch_cannot_use_is_a_problem_with_its_fix(
    tmp_path: Path, sign: Path, build: str | None, says: str, fix: str
) -> None:
    (tmp_path / sign).parent.mkdir(parents=True)
    (tmp_path / sign).write_text("R36 (release)\n")
    this_torch = SimpleNamespace(__version__="2.5.0", version=SimpleNamespace(cuda=build))
    row = accelerator_check(this_torch, "auto", tmp_path)
    assert row.status == "problem"
    assert says in row.summary
    assert fix in row.fix
    # asked for the CPU, the GPU's idleness is the person's choice
    assert accelerator_check(this_torch, "cpu", tmp_path).status == "ok"


@no_gpu
def test_asking_for_cuda_where_there_is_none_is_a_problem(tmp_path: Path) -> None:
    row = accelerator_check(torch, "cuda", tmp_path)
    assert row.status == "problem"
    assert "no CUDA device" in row.summary
    assert "--accelerator auto" in row.fix
