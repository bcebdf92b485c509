import json
import os

import pytest
import structlog

from common.device import device_fingerprint
from common.errors import ConfigError
from common.exit_codes import ExitCode
from common.model_key import model_key
from common.profile import Profile
from common.store import Store
from common.zoo import ModelSpec
from services.profiler.main import main, parse_options


@pytest.fixture(autouse=True)
def _default_logging():
    """`main` points structlog at the captured stderr, which pytest closes after the test."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def run_main(redis_url, cluster_name, capsys):
    """Run `main` with the test's Redis; returns (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        argv = ["--redis-url", redis_url, "--cluster", cluster_name, "--log-format", "json"]
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *args])
        out, err = capsys.readouterr()
        return int(exit_info.value.code or 0), out, err

    return run


def _events(stderr: str) -> list[str]:
    return [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]


QUICK = ("--model", "mlp", "--batch-sizes", "1,2,4", "--repeats", "1", "--warmup", "0")


def test_main_measures_stores_and_then_reuses(run_main, redis_url, cluster_name, tmp_path):
    out = tmp_path / "profile.json"
    code, stdout, stderr = run_main(*QUICK, "--threads", "1", "--out", str(out))
    assert code == ExitCode.OK, stderr
    assert "profile measured and stored" in _events(stderr)
    assert _events(stderr).count("batch size measured") == 3
    assert "total" in stdout and "mlp(num_classes=10)" in stdout  # the summary table
    written = Profile.model_validate_json(out.read_text())
    assert written.batch_sizes == [1, 2, 4]
    # the profile of a device with two cores carries the split's measured gain
    two_cores = len(os.sched_getaffinity(0)) >= 2
    assert (written.split_gain is not None) == two_cores
    assert ("split gain measured" in _events(stderr)) == two_cores

    store = Store(redis_url, cluster_name)
    key, device = model_key(ModelSpec(name="mlp")), device_fingerprint(1)
    assert written.device == device
    assert Profile.model_validate(store.get_json("profile", key, device)) == written
    assert device in store.get_fields("profiles", key)

    code, _, stderr = run_main(*QUICK, "--threads", "1")
    assert code == ExitCode.OK
    assert "profile reused from Redis" in _events(stderr)
    assert "profile measured and stored" not in _events(stderr)
    assert Profile.model_validate(store.get_json("profile", key, device)) == written

    code, _, stderr = run_main(*QUICK, "--threads", "1", "--refresh")
    assert "profile measured and stored" in _events(stderr)
    assert Profile.model_validate(store.get_json("profile", key, device)).created > written.created

    # another thread count is another device: measured, stored beside the first
    code, _, stderr = run_main(*QUICK, "--threads", "2")
    assert "profile measured and stored" in _events(stderr)
    assert len(store.get_fields("profiles", key)) == 2
    store.close()


def test_other_batch_sizes_are_measured_again(run_main):
    run_main(*QUICK, "--threads", "1")
    code, _, stderr = run_main(
        *QUICK[:2], "--batch-sizes", "1,8", "--repeats", "1", "--threads", "1"
    )
    assert code == ExitCode.OK
    assert "stored profile lacks batch sizes" in _events(stderr)


def test_model_options_reach_the_model(run_main, tmp_path):
    out = tmp_path / "p.json"
    code, _, stderr = run_main(*QUICK, "--options", "hidden=64", "--out", str(out))
    assert code == ExitCode.OK, stderr
    assert "hidden=64" in Profile.model_validate_json(out.read_text()).model


def test_unknown_model_and_bad_options_exit_with_config(run_main):
    code, _, stderr = run_main("--model", "nope", "--batch-sizes", "1")
    assert code == ExitCode.CONFIG
    assert "unknown model name 'nope'" in stderr
    code, _, stderr = run_main("--model", "mlp", "--options", "hidden")
    assert code == ExitCode.CONFIG
    assert "is not key=value" in stderr


def test_unreachable_redis_exits_with_unreachable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--redis-url", "redis://127.0.0.1:1/0", "--log-format", "json", *QUICK])
    assert exit_info.value.code == ExitCode.UNREACHABLE
    assert "does not answer" in capsys.readouterr().err


def test_parse_options():
    assert parse_options("") == {}
    assert parse_options('{"width_mult": 0.5, "name": "x"}') == {"width_mult": 0.5, "name": "x"}
    assert parse_options("depth=3, act=gelu,flag=true") == {"depth": 3, "act": "gelu", "flag": True}
    with pytest.raises(ConfigError, match="numbers, strings or booleans"):
        parse_options('{"a": [1]}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_options("{oops")


def test_progress_bar_on_a_terminal(run_main, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich treats the captured stderr as a terminal
    code, _, stderr = run_main(*QUICK, "--threads", "1")
    assert code == ExitCode.OK, stderr
    assert "batch size measured" not in stderr  # the bar replaces the per-batch log lines
    assert "profile measured and stored" in stderr
