"""The shared start-up of every service: exit codes, one-line errors, signals.

The signal tests run a tiny service body through `run_service` in a child
process and send it real signals: a clean stop runs the body's cleanup and
ends with the body's own code; a second signal ends a stop that hangs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common.bootstrap import Stop, exit_code_of, run_service
from common.errors import AsteroidError, ConfigError, StoreError, StoreUnavailable
from common.exit_codes import ExitCode
from common.extras import MissingExtraError
from common.settings import CommonSettings
from common.version import VERSION

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("bad"), ExitCode.CONFIG),
        (MissingExtraError("needs the 'plots' extra"), ExitCode.CONFIG),
        (StoreUnavailable("Redis stayed away"), ExitCode.UNREACHABLE),
        (StoreError("missing"), ExitCode.JOB_FAILED),
        (AsteroidError("the job could not finish"), ExitCode.JOB_FAILED),
        (KeyboardInterrupt("SIGTERM"), ExitCode.INTERRUPTED),
        (RuntimeError("a bug"), ExitCode.FAILED),
    ],
)
def test_each_error_has_its_documented_exit_code(exc, code):
    assert exit_code_of(exc) == code


def _raising(exc: BaseException):
    def body(_settings: CommonSettings, _stop: Stop) -> ExitCode:
        raise exc

    return body


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (MissingExtraError("a picture needs the 'plots' extra: pip install 'x[plots]'"), 2),
        (ConfigError("stage 2 needs 3.1 GiB,\ndevice nano-1 has 1.5 GiB"), 2),
        (StoreUnavailable("Redis at redis://u:hunter2@db:6379/0 stayed away"), 4),
    ],
)
def test_an_error_raised_on_purpose_is_one_line_without_traceback(capsys, exc, code):
    assert run_service("toy", CommonSettings, _raising(exc), []) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("asteroid-toy: error: ")
    assert "Traceback" not in err
    assert "hunter2" not in err
    if isinstance(exc, MissingExtraError):
        assert err == f"asteroid-toy: error: {exc}\n"


def test_an_unexpected_error_shows_its_traceback(capsys):
    code = run_service("toy", CommonSettings, _raising(RuntimeError("redis://u:hunter2@db")), [])
    assert code == ExitCode.FAILED
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "in body" in err  # where it was raised
    assert err.rstrip().endswith("RuntimeError: redis://u:***@db")


def test_the_body_gets_the_parsed_settings_and_its_code_is_returned(capsys):
    seen: list[CommonSettings] = []

    def body(settings: CommonSettings, stop: Stop) -> ExitCode:
        seen.append(settings)
        assert not stop.is_set()
        return ExitCode.JOB_FAILED

    assert run_service("toy", CommonSettings, body, ["--heartbeat-s", "7"]) == 3
    assert seen[0].heartbeat_s == 7


def test_a_bad_flag_and_version_end_before_the_body(capsys):
    body = _raising(AssertionError("the body must not run"))
    assert run_service("toy", CommonSettings, body, ["--heartbeat-s", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asteroid-toy: error: ") and len(err.splitlines()) == 1
    assert run_service("toy", CommonSettings, body, ["--version"]) == 0
    assert capsys.readouterr().out == f"asteroid-toy {VERSION}\n"


def test_the_service_name_is_bound_to_every_log_line(capsys):
    from common.logging import get_logger

    def body(_settings: CommonSettings, _stop: Stop) -> ExitCode:
        get_logger("toy").info("hello")
        return ExitCode.OK

    assert run_service("toy", CommonSettings, body, ["--log-format", "json"]) == 0
    line = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert (line["event"], line["service"]) == ("hello", "toy")


def test_the_previous_signal_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    during: dict[int, object] = {}

    def body(_settings: CommonSettings, stop: Stop) -> ExitCode:
        during.update({sig: signal.getsignal(sig) for sig in before})
        return ExitCode.OK

    assert run_service("toy", CommonSettings, body, []) == 0
    assert all(isinstance(getattr(h, "__self__", None), Stop) for h in during.values())
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_stop_tells_late_callbacks_at_once_and_interrupts_inside_interrupting():
    stop = Stop("asteroid-toy")
    early: list[str] = []
    stop.on_stop(early.append)
    with stop.interrupting(), pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        stop.handle(signal.SIGTERM, None)
    assert stop.is_set() and stop.signal == "SIGTERM" and early == ["SIGTERM"]
    late: list[str] = []
    stop.on_stop(late.append)
    assert late == ["SIGTERM"]
    with pytest.raises(KeyboardInterrupt), stop.interrupting():
        pytest.fail("a stopped service must not enter an interruptible section")


def test_outside_interrupting_a_stop_only_sets_the_event():
    stop = Stop("asteroid-toy")
    stop.handle(signal.SIGINT, None)  # no KeyboardInterrupt
    assert stop.event.is_set()


# A service in miniature: says "ready", waits for the stop (by the event, or unwound by
# KeyboardInterrupt), then cleans up by writing a file. `hang` ignores the stop.
TOY = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from common.bootstrap import run_service
    from common.exit_codes import ExitCode
    from common.settings import CommonSettings

    mode, done = sys.argv[1], Path(sys.argv[2])

    def body(settings, stop):
        stop.on_stop(lambda name: print("stopping", name, flush=True))
        print("ready", flush=True)
        try:
            if mode == "event":
                stop.event.wait(60)
            elif mode == "interrupt":
                with stop.interrupting():
                    time.sleep(60)
            else:
                time.sleep(60)
            return ExitCode.OK
        finally:
            done.write_text("cleaned up")

    sys.exit(run_service("toy", CommonSettings, body, ["--log-format", "json"]))
    """
)


def _start(mode: str, done: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", TOY, mode, str(done)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.stderr else ""
    return proc


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    return proc.returncode, out, err


@pytest.mark.parametrize(
    ("mode", "sig", "code"),
    [
        ("event", signal.SIGTERM, ExitCode.OK),
        ("event", signal.SIGINT, ExitCode.OK),
        ("interrupt", signal.SIGTERM, ExitCode.INTERRUPTED),
        ("interrupt", signal.SIGINT, ExitCode.INTERRUPTED),
    ],
)
def test_a_signal_is_a_clean_stop(tmp_path, mode, sig, code):
    done = tmp_path / "done"
    proc = _start(mode, done)
    proc.send_signal(sig)
    returncode, out, err = _finish(proc)
    assert returncode == code, err
    assert done.read_text() == "cleaned up"
    assert out == f"stopping {sig.name}\n"
    assert "Traceback" not in err
    if mode == "interrupt":
        line = json.loads(err.splitlines()[-1])
        assert (line["event"], line["signal"], line["service"]) == ("stopped", sig.name, "toy")


def test_a_second_signal_ends_a_stop_that_hangs(tmp_path):
    done = tmp_path / "done"
    proc = _start("hang", done)
    assert proc.stdout is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "stopping SIGTERM\n"  # heard, and ignored by the body
    time.sleep(0.2)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    returncode, _, err = _finish(proc)
    assert returncode == ExitCode.INTERRUPTED, err
    assert time.monotonic() - t0 < 10
    assert err == "asteroid-toy: SIGINT again: exiting without cleanup\n"
    assert not done.exists()  # forced: no cleanup
