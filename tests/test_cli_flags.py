"""Bad flags are one line and exit code 2, --version answers, and help does not load torch.

In-process calls of each service's `main` cover every kind of bad value; the
subprocess tests run the installed commands (and `python -m services.cli`, the
`asteroid` command's own `main`) to show what a person sees: no traceback.
"""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from common.cli_args import parse_settings
from common.entry_points import SERVICE_SCRIPTS, service_command
from common.exit_codes import ExitCode
from common.settings import CommonSettings, CoordinatorSettings, ProfilerSettings, WorkerSettings
from common.version import VERSION
from services.cli import main as asteroid_main
from tests.pyproject import pyproject

ROOT = Path(__file__).resolve().parent.parent
MAINS = {
    "coordinator": "services.coordinator.main",
    "dashboard": "services.dashboard.main",
    "federation": "services.federation.main",
    "gateway": "services.gateway.main",
    "planner": "services.planner.service",
    "profiler": "services.profiler.main",
    "worker": "services.worker.main",
}


def run_main(service, args):
    main = importlib.import_module(MAINS[service]).main
    with pytest.raises(SystemExit) as stop:
        main(args)
    return stop.value.code


def one_error_line(err: str, prog: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("service", "args", "says"),
    [
        (
            "worker",
            ["--memory-budget", "2GX"],
            "--memory-budget (ASTEROID_MEMORY_BUDGET): expected",
        ),
        ("profiler", ["--memory-budget", "-1"], "like 1073741824, 2GB or 512MiB (got '-1')"),
        ("worker", ["--pool-max-bytes", "0"], "--pool-max-bytes"),
        ("worker", ["--memory-budget", "2 GB please"], "(got '2 GB please')"),
        ("worker", ["--redis-url", "localhost:6379"], "expected a URL like redis://HOST:6379/0"),
        ("planner", ["--coordinator", "127.0.0.1:5555"], "expected an address like tcp://"),
        ("coordinator", ["--bind", "localhost"], "--bind (ASTEROID_BIND)"),
        ("coordinator", ["--link-bandwidth", "1gbit"], "that is bits per second"),
        ("coordinator", ["--link-bandwidth", "125M"], "a number or one like 125MB/s"),
        ("planner", ["--log-level", "loud"], "'debug', 'info', 'warning', 'error' or 'critical'"),
        ("profiler", ["--max-tensor-bytes", "huge"], "--max-tensor-bytes"),
        ("worker", ["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
        ("coordinator", ["--heartbeat-s"], "argument --heartbeat-s: expected one argument"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(capsys, service, args, says):
    assert run_main(service, args) == ExitCode.CONFIG
    out, err = capsys.readouterr()
    assert says in one_error_line(err, f"asteroid-{service}")
    assert out == ""


def test_a_bad_variable_is_named_like_its_flag(capsys, monkeypatch):
    monkeypatch.setenv("ASTEROID_LOG_LEVEL", "verbose")
    assert run_main("planner", []) == ExitCode.CONFIG
    line = one_error_line(capsys.readouterr().err, "asteroid-planner")
    assert "--log-level (ASTEROID_LOG_LEVEL)" in line and "(got 'verbose')" in line


def test_a_url_without_scheme_is_refused_without_showing_its_password(capsys):
    assert run_main("worker", ["--redis-url", "admin:hunter2@db:6379"]) == ExitCode.CONFIG
    line = one_error_line(capsys.readouterr().err, "asteroid-worker")
    assert "hunter2" not in line and "***@db:6379" in line


@pytest.mark.parametrize("service", sorted(MAINS))
def test_every_service_prints_its_version(capsys, service):
    assert run_main(service, ["--version"]) == 0
    assert capsys.readouterr().out == f"asteroid-{service} {VERSION}\n"


@pytest.mark.parametrize(
    ("cls", "args", "field", "value"),
    [
        (WorkerSettings, ["--memory-budget", "2GB"], "memory_budget", 2 * 10**9),
        (ProfilerSettings, ["--memory-budget", "512MiB"], "memory_budget", 512 << 20),
        (WorkerSettings, ["--pool-max-bytes", "1073741824"], "pool_max_bytes", 1 << 30),
        (CoordinatorSettings, ["--link-bandwidth", "125MB/s"], "link_bandwidth", 125e6),
        (CoordinatorSettings, ["--link-bandwidth", "12.5e6"], "link_bandwidth", 12.5e6),
        (CoordinatorSettings, ["--link-probe-bytes", "4MiB"], "link_probe_bytes", 4 << 20),
        (CommonSettings, ["--log-level", "WARNING"], "log_level", "warning"),
        (CommonSettings, ["--coordinator", "tcp://[::1]:5555"], "coordinator", "tcp://[::1]:5555"),
        (CommonSettings, ["--redis-url", "unix:///run/redis.sock"], "redis_url", None),
        (CoordinatorSettings, ["--bind", "tcp://*:5555"], "bind", "tcp://*:5555"),
    ],
)
def test_good_values_parse(cls, args, field, value):
    got = getattr(parse_settings(cls, args, "asteroid-test"), field)
    assert got == (args[1] if value is None else value)


def test_the_service_table_matches_the_installed_commands():
    scripts = pyproject()["project"]["scripts"]
    for service, script in SERVICE_SCRIPTS.items():
        assert scripts[script].startswith(MAINS[service] + ":"), script
    assert scripts["asteroid"] == "services.cli:main"


def run(cmd, cwd=ROOT, timeout=120):
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


BAD_BY_SERVICE = {
    "coordinator": ["--link-bandwidth", "100Mbps"],
    "federation": ["--spec", "fed.yaml", "--done-grace-s", "0"],
    "gateway": ["--max-requests", "0"],
    "planner": ["--redis-url", "127.0.0.1:6379"],
    "profiler": ["--log-level", "trace"],
    "worker": ["--memory-budget", "2 GB please"],
}


def test_installed_commands_say_one_line_and_no_traceback(tmp_path):
    """All ten runs at once: each pays a fresh interpreter's imports (torch for two)."""
    runs = {}
    for service, args in BAD_BY_SERVICE.items():
        for kind, argv in (("bad", args), ("version", ["--version"])):
            out, err = tmp_path / f"{service}-{kind}.out", tmp_path / f"{service}-{kind}.err"
            with out.open("w") as o, err.open("w") as e:
                proc = subprocess.Popen(
                    [*service_command(service), *argv], stdout=o, stderr=e, stdin=subprocess.DEVNULL
                )
            runs[service, kind] = (proc, out, err)
    try:
        codes = {key: proc.wait(timeout=240) for key, (proc, _, _) in runs.items()}
    finally:
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for (service, kind), (_, out, err) in runs.items():
        if kind == "bad":
            assert codes[service, kind] == ExitCode.CONFIG, err.read_text()
            one_error_line(err.read_text(), f"asteroid-{service}")
            assert out.read_text() == ""
        else:
            assert codes[service, kind] == 0, err.read_text()
            assert out.read_text() == f"asteroid-{service} {VERSION}\n"


ASTEROID = [sys.executable, "-m", "services.cli"]


@pytest.mark.parametrize(
    ("args", "where", "says"),
    [
        (["demo", "--workers", "0"], "asteroid demo", "Invalid value for '--workers'"),
        (["demo", "--no-such-flag"], "asteroid demo", "No such option: --no-such-flag"),
        (["status", "--redis-url", "localhost:6379"], "asteroid", "expected a URL like redis://"),
        (["train", "x.yaml", "--coordinator", "host:5555"], "asteroid", "--coordinator"),
        (["no-such-command"], "asteroid", "No such command 'no-such-command'"),
    ],
)
def test_asteroid_bad_flags_are_one_line_and_exit_2(capsys, args, where, says):
    with pytest.raises(SystemExit) as stop:
        asteroid_main(args)
    assert stop.value.code == ExitCode.CONFIG
    assert says in one_error_line(capsys.readouterr().err, where)


def test_asteroid_version_and_a_bad_flag_as_a_person_runs_them():
    version = run([*ASTEROID, "--version"])
    assert (version.returncode, version.stdout) == (0, f"asteroid {VERSION}\n")
    bad = run([*ASTEROID, "demo", "--threads", "many"])
    assert bad.returncode == ExitCode.CONFIG
    assert "'--threads'" in one_error_line(bad.stderr, "asteroid demo")


NO_TORCH = """
import sys
from services.cli import main
for args in (["--help"], ["demo", "--help"], ["testbed", "up", "--help"], ["--version"]):
    try:
        main(args)
    except SystemExit as stop:
        assert stop.code == 0, (args, stop.code)
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("common", "services"))
print("TORCH" if "torch" in sys.modules else "NO-TORCH", *ours)
"""


def test_help_and_version_do_not_import_torch():
    res = run([sys.executable, "-c", NO_TORCH])
    assert res.returncode == 0, res.stderr
    verdict, *modules = res.stdout.splitlines()[-1].split()
    assert verdict == "NO-TORCH", "torch came in with one of: " + " ".join(modules)
