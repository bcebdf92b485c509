"""One exit-code table, enforced: every `asteroid` command as a person runs it.

Each command runs as a real subprocess against an unreachable Redis (a closed
port), a missing coordinator (a closed port), a bad argument, a bad file and an
unknown option; the test checks the exit code (`common.exit_codes.ExitCode`)
and that what it says on stderr is one line, never a traceback. The commands
are read from the typer app, so a new command without a row here fails: add
its row to ROWS (a case per situation, or None saying why it does not apply).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

from common.exit_codes import ExitCode
from services.cli import app
from services.cli import main as asteroid_main

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 120.0
"""Longest one command may take; the slowest case is a locate that waits for its coordinator."""
SITUATIONS = ("redis", "coordinator", "argument", "file", "option")


@dataclass(frozen=True)
class Case:
    """Arguments after the command's path, with {R} {C} {D} {JOB} {BADJOB} ... filled in."""

    args: tuple[str, ...]
    code: ExitCode
    report: bool = False
    """The command prints a report on stdout (doctor): then stderr must be empty."""
    alone: bool = False
    """Run as a subprocess (a command that would start services if its input were taken)."""


def case(*args: str, code: ExitCode, report: bool = False, alone: bool = False) -> Case:
    return Case(args, code, report, alone)


U, C2 = ExitCode(4), ExitCode.CONFIG  # 4 by number: the test runs on older code too
NO_REDIS = "does not read Redis"
NO_COORD = "does not ask a coordinator"
NO_FILE = "reads no file"

ROWS: dict[str, dict[str, Case | str]] = {
    "profile": {
        "redis": case("--redis-url", "{R}", "--model", "small_cnn", code=U),
        "coordinator": "waits 30 s for a coordinator to say where Redis is (then 4, as `redis`)",
        "argument": case("--repeats", "0", "--redis-url", "{R}", code=C2),
        "file": case("--model", "small_cnn", "--keys", "{D}/no-keys", "--serve", code=C2),
    },
    "demo": {
        "redis": "starts its own Redis (--redis-url is covered by `up`)",
        "coordinator": "starts its own coordinator",
        "argument": case("--workers", "0", code=C2),  # refused by its option's range
        "file": case("--job", "{BADJOB}", code=C2, alone=True),
    },
    "examples": {
        "redis": NO_REDIS,
        "coordinator": NO_COORD,
        "argument": case("{JOB}", code=C2),  # a file where a folder is wanted
        "file": NO_FILE,
    },
    "up": {
        "redis": "starts every service against it: an integration test's, not this one's",
        "coordinator": "starts its own coordinator",
        "argument": case("--workers", "0", code=C2),  # refused by its option's range
        "file": case("--job", "{BADJOB}", code=C2, alone=True),
    },
    "train": {
        "redis": "submits to the coordinator first: covered by `coordinator`",
        "coordinator": case("{JOB}", "--coordinator", "{C}", "--reply-timeout", "1", code=U),
        "argument": case("{JOB}", "--reply-timeout", "0", code=C2),
        "file": case("{BADJOB}", "--coordinator", "{C}", code=C2),
    },
    "serve": {
        "redis": NO_REDIS,
        "coordinator": case("{SERVE}", "--coordinator", "{C}", "--reply-timeout", "1", code=U),
        "argument": case("{SERVE}", "--reply-timeout", "0", code=C2),
        "file": case("{BADSERVE}", "--coordinator", "{C}", code=C2),
    },
    "infer": {
        "redis": NO_REDIS,
        "coordinator": case("s1", "--ids", "1,2", "--coordinator", "{C}", "--timeout", "1", code=U),
        "argument": case("s1", "--ids", "1,x", "--coordinator", "{C}", code=C2),
        "file": case("s1", "--prompt", "hi", "--model-dir", "{D}/no-model", code=C2),
    },
    "plan": {
        "redis": "without Redis, a profile name only Redis knows is CONFIG, naming the kinds",
        "coordinator": NO_COORD,
        "argument": case(
            "--cluster",
            "{CLUSTER}",
            "--global-batch",
            "8",
            "--microbatches",
            "2",
            "--planner",
            "no_such_planner",
            "--redis-url",
            "{R}",
            code=C2,
        ),
        "file": case(
            "--cluster",
            "{BADJOB}",
            "--global-batch",
            "8",
            "--microbatches",
            "2",
            "--redis-url",
            "{R}",
            code=C2,
        ),
    },
    "status": {
        "redis": case("--redis-url", "{R}", code=U),
        "coordinator": "reads Redis only",
        "argument": case("--job", "../x", "--redis-url", "{R}", code=C2),
        "file": NO_FILE,
    },
    "cancel": {
        "redis": NO_REDIS,
        "coordinator": case("j1", "--coordinator", "{C}", "--reply-timeout", "1", code=U),
        "argument": case("../x", "--coordinator", "{C}", code=C2),
        "file": NO_FILE,
    },
    "drain": {
        "redis": NO_REDIS,
        "coordinator": case("d1", "--coordinator", "{C}", "--reply-timeout", "1", code=U),
        "argument": case("d1", "--reply-timeout", "0", code=C2),
        "file": NO_FILE,
    },
    "export": {
        "redis": case("j1", "--out", "{D}/w.safetensors", "--redis-url", "{R}", code=U),
        "coordinator": "reads Redis only",
        "argument": case("../x", "--out", "{D}/w.safetensors", "--redis-url", "{R}", code=C2),
        "file": NO_FILE,
    },
    "join": {
        "redis": "the worker is told where Redis is by its coordinator",
        "coordinator": "a device may start before its coordinator: join waits for it",
        "argument": case("not-an-address", code=C2),
        "file": case("{C}", "--keys", "{D}/no-keys", code=C2),
    },
    "doctor": {
        "redis": case(
            "--redis-url",
            "{R}",
            "--coordinator",
            "{C}",
            "--timeout",
            "0.5",
            code=ExitCode.DEVICE_FAILED,
            report=True,
        ),
        "coordinator": case(
            "--coordinator", "{C}", "--timeout", "0.5", code=ExitCode.DEVICE_FAILED, report=True
        ),
        "argument": case("--timeout", "0", code=C2),
        "file": case(
            "--keys",
            "{D}/no-keys",
            "--coordinator",
            "{C}",
            "--timeout",
            "0.5",
            code=ExitCode.DEVICE_FAILED,
            report=True,
        ),
    },
    "export-metrics": {
        "redis": case("j1", "--out", "{D}/m", "--redis-url", "{R}", code=U),
        "coordinator": "reads Redis only",
        "argument": case("j1", "--out", "{D}/m", "--format", "xml", code=C2),
        "file": NO_FILE,
    },
    "federation": {
        "redis": case("f1", "--redis-url", "{R}", code=U),
        "coordinator": "reads Redis only",
        "argument": case("../x", "--redis-url", "{R}", code=C2),
        "file": NO_FILE,
    },
    "dashboard": {
        "redis": case("--redis-url", "{R}", "--port", "0", code=U),
        "coordinator": "asks 10 s where Redis is, with a progress line (then 4, as `redis`)",
        "argument": case("--port", "70000", code=C2),
        "file": NO_FILE,
    },
    "testbed up": {
        "redis": "starts its own Redis",
        "coordinator": "starts its own coordinator",
        "argument": case("--preset", "no-such-preset", code=C2, alone=True),
        "file": case("--file", "{BADJOB}", code=C2, alone=True),
    },
    "testbed down": {
        "redis": NO_REDIS,
        "coordinator": NO_COORD,
        "argument": "takes only --tag, any text (a bad option is `option`)",
        "file": NO_FILE,
    },
    "testbed status": {
        "redis": NO_REDIS,
        "coordinator": NO_COORD,
        "argument": "takes no argument (a bad option is `option`)",
        "file": NO_FILE,
    },
    "keys init": {
        "redis": NO_REDIS,
        "coordinator": NO_COORD,
        "argument": case("{D}/keys", "--worker", "../bad", code=C2),
        "file": case("{JOB}", "--worker", "w1", code=C2),  # a file where the folder goes
    },
    **{
        f"deploy {sub}": {
            "redis": "reaches devices over ssh, not Redis",
            "coordinator": NO_COORD,
            "argument": case("--inventory", "{D}/no-inventory.yaml", "--keys", "{D}", code=C2),
            "file": case("--inventory", "{BADJOB}", "--keys", "{D}", code=C2),
        }
        for sub in ("up", "status", "down", "env")
    },
}
"""Per command path: each situation's case, or why it does not apply."""


def command_paths(group: Any, prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """Every leaf command of the app, as the words a person types after `asteroid`."""
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):  # a group (typer ships its own click)
            yield from command_paths(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name))


def closed_port() -> int:
    """A port nothing listens on (bound then released; nothing here binds it again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("exit-codes")
    job = (ROOT / "services/cli/examples/job-demo.yaml").read_text()
    (d / "job.yaml").write_text(job)
    (d / "bad-job.yaml").write_text(job.replace("eval_every:", "eval_evry:"))
    serve = (ROOT / "services/cli/examples/serve-gpt2.yaml").read_text()
    (d / "serve.yaml").write_text(serve)
    (d / "bad-serve.yaml").write_text(serve.replace("seq_len:", "seq_lenn:"))
    devices = "".join(
        f"- {{name: d{i}, profile: measured-{i}, memory_bytes: 4GiB}}\n" for i in (0, 1)
    )
    (d / "cluster.yaml").write_text(f"devices:\n{devices}bandwidth: 125MB/s\n")  # Redis's profiles
    (d / "state").mkdir()
    return {
        "R": f"redis://127.0.0.1:{closed_port()}/0",
        "C": f"tcp://127.0.0.1:{closed_port()}",
        "D": str(d),
        "JOB": str(d / "job.yaml"),
        "BADJOB": str(d / "bad-job.yaml"),
        "SERVE": str(d / "serve.yaml"),
        "BADSERVE": str(d / "bad-serve.yaml"),
        "CLUSTER": str(d / "cluster.yaml"),
    }


def run_asteroid(args: list[str], state: str) -> subprocess.CompletedProcess[str]:
    """`asteroid ARGS` as a person runs it: its own process, no ASTEROID_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    env.update(XDG_STATE_HOME=state, COLUMNS="100", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def run_in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> Outcome:
    """`asteroid ARGS` through the installed command's own `main`, here (torch loads once)."""
    capsys.readouterr()
    try:
        asteroid_main(args)
        code: object = 0
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return Outcome(code if isinstance(code, int) else 1, out, err)


@dataclass(frozen=True)
class Outcome:
    """What a run ended with."""

    code: int
    stdout: str
    stderr: str


def test_every_command_has_a_row() -> None:
    commands = set(command_paths(typer.main.get_command(app)))
    missing = sorted(commands - set(ROWS))
    assert not missing, f"add a row to ROWS for: {', '.join(f'asteroid {c}' for c in missing)}"
    assert not sorted(set(ROWS) - commands), "rows for commands the app no longer has"
    for path, row in ROWS.items():
        assert set(row) == set(SITUATIONS) - {"option"}, path


def _judge(shown: str, situation: str, want: Case, done: Outcome) -> str | None:
    """What is wrong with `done` for `want` (None: nothing)."""
    err = [line for line in done.stderr.splitlines() if line.strip()]
    problems = []
    if done.code != want.code:
        problems.append(f"exit {done.code}, wanted {int(want.code)} ({want.code.name})")
    if "Traceback" in done.stderr + done.stdout:
        problems.append("a traceback")
    if want.report and err:
        problems.append(f"{len(err)} lines on stderr beside the report")
    if not want.report and len(err) != 1:
        problems.append(f"{len(err)} lines on stderr, wanted one")
    if not problems:
        return None
    tail = (done.stderr.strip() or done.stdout.strip())[-600:]
    return f"{situation}: `{shown}`: {'; '.join(problems)}\n    {tail}"


def _alone(path: str, situation: str, want: Case, places: dict[str, str]) -> str | None:
    args = [a.format(**places) for a in want.args]
    shown = f"asteroid {path} {' '.join(args)}"
    try:
        done = run_asteroid([*path.split(), *args], places["D"] + "/state")
    except subprocess.TimeoutExpired:
        return f"{situation}: `{shown}` ran past {RUN_TIMEOUT_S:.0f} s"
    return _judge(shown, situation, want, Outcome(done.returncode, done.stdout, done.stderr))


def all_cases() -> list[tuple[str, str, Case]]:
    """Every (command, situation, case), an unknown option included for every command."""
    work: list[tuple[str, str, Case]] = []
    for path, row in ROWS.items():
        work.append((path, "option", case("--no-such-option", code=C2)))
        work += [(path, s, want) for s, want in row.items() if isinstance(want, Case)]
    return work


@pytest.mark.timeout(600)  # some 75 runs; a few minutes on a loaded 2-core machine
def test_every_command_follows_the_exit_code_table(
    places: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [k for k in os.environ if k.startswith("ASTEROID_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_STATE_HOME", places["D"] + "/state")
    monkeypatch.setenv("COLUMNS", "100")
    work = all_cases()
    wrong: list[str] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        alone = [
            (w, pool.submit(_alone, *w, places)) for w in work if w[2].alone
        ]  # started first, they run while the rest runs here
        for path, situation, want in work:
            if want.alone:
                continue
            args = [a.format(**places) for a in want.args]
            done = run_in_process([*path.split(), *args], capsys)
            verdict = _judge(f"asteroid {path} {' '.join(args)}", situation, want, done)
            if verdict:
                wrong.append(f"asteroid {path}: {verdict}")
        wrong += [f"asteroid {w[0]}: {v}" for w, f in alone if (v := f.result())]
    assert not wrong, f"{len(wrong)} of {len(work)} cases:\n" + "\n".join(wrong)


@pytest.mark.parametrize("situation", ["redis", "coordinator", "file"])
def test_a_real_process_says_one_line_too(situation: str, places: dict[str, str]) -> None:
    """What a person sees, in its own process: the same code, one line, no traceback."""
    path = {"redis": "status", "coordinator": "cancel", "file": "train"}[situation]
    want = ROWS[path][situation]
    assert isinstance(want, Case)
    assert _alone(path, situation, want, places) is None


def test_a_second_coordinator_on_a_used_port_says_so_in_one_line(places: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bind = f"tcp://127.0.0.1:{port}"
        done = subprocess.run(
            [sys.executable, "-m", "services.coordinator.main", "--bind", bind],
            cwd=ROOT,
            env={**env, "ASTEROID_REDIS_URL": places["R"]},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert done.stderr.splitlines() == [
        f"asteroid-coordinator: error: port {port} is in use ({bind}): another coordinator? "
        "stop it, or give this one another --bind (ASTEROID_BIND)"
    ]


@pytest.mark.parametrize(
    ("refusal", "code"),
    [("invalid", ExitCode.CONFIG), ("no_job", ExitCode.CONFIG), ("failed", ExitCode(3))],
)
def test_infer_refused_for_its_input_is_config_not_job_failed(
    refusal: str,
    code: ExitCode,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A coordinator's refusal of bad ids is the request's fault (it was 3, as a failed job)."""
    import services.cli.serve as serve
    from common.serving_messages import InferReply

    def refused(*args: object, **kwargs: object) -> Iterator[InferReply]:
        yield InferReply(serve_id="s1", request=1, ok=False, error="no", refusal=refusal)  # type: ignore[arg-type]

    monkeypatch.setattr(serve, "stream_request", refused)
    done = run_in_process(["infer", "s1", "--ids", "99999", "--coordinator", "tcp://h:1"], capsys)
    assert done.code == code
    assert done.stderr.splitlines() == ["error: no"]
