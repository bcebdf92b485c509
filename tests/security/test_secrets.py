"""A Redis password never shows in logs, errors or status output.

The attack: a Redis URL carries its password (``redis://user:pass@host``), and
when Redis did not answer, `asteroid status`, the profiler and others printed
redis-py's connection kwargs, ``'password': '...'`` included, to the screen
and the logs. The processes here are real (`asteroid status`, `asteroid
export`, `asteroid plan`, the profiler and the coordinator) and point at a
loopback port where nothing listens; each must say clearly that Redis does
not answer, where (the URL, its password hidden), and never the password.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import structlog

from common.errors import StoreError
from common.exit_codes import ExitCode
from common.logging import configure_logging, get_logger, mask_secrets
from common.ports import free_port
from common.secrets import MASK, is_secret_key, mask, mask_text, mask_url
from common.settings import CommonSettings, CoordinatorSettings
from common.store import Store
from tests.cluster import LocalCluster

PASSWORD = "Sup3r-s3cret-pw"
"""Distinct enough that finding it anywhere in an output means it leaked."""
USER = "trainer"


def _dead_url() -> str:
    """A Redis URL with credentials, for a loopback port where nothing listens."""
    return f"redis://{USER}:{PASSWORD}@127.0.0.1:{free_port()}/0"


# --- the masker ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:pw@10.0.0.2:6379/0", f"redis://alice:{MASK}@10.0.0.2:6379/0"),
        ("redis://:pw@host/1", f"redis://:{MASK}@host/1"),
        ("rediss://only-a-token@host:6380", f"rediss://{MASK}@host:6380"),
        ("redis://alice:p@ss@host/0", f"redis://alice:{MASK}@host/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://h:6379/0?password=pw&db=1", f"redis://h:6379/0?password={MASK}&db=1"),
        ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=0"),
    ],
)
def test_url_password_is_masked_and_the_rest_kept(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_text_with_urls_and_redis_kwargs_loses_every_password() -> None:
    client = redis.Redis.from_url(_dead_url())
    try:
        kwargs = client.connection_pool.connection_kwargs
        text = (
            f"Redis at {kwargs} failed; pool {client.connection_pool!r}; "
            f"set ASTEROID_REDIS_URL={_dead_url()} or password={PASSWORD} "
            f'or {{"password": "{PASSWORD}"}}'
        )
    finally:
        client.close()
    assert PASSWORD in text  # the inputs really hold it
    masked = mask_text(text)
    assert PASSWORD not in masked
    assert f"'password': '{MASK}'" in masked
    assert f"{USER}:{MASK}@127.0.0.1" in masked
    assert "'host': '127.0.0.1'" in masked  # what helps to find the Redis stays


def test_nested_values_and_exceptions_are_masked() -> None:
    value = {
        "redis": {"url": _dead_url(), "password": PASSWORD, "db": 0},
        "peers": [("a", _dead_url()), {"token": PASSWORD}],
        "api_key": PASSWORD,
        "redis_key": "asteroid:c:profile:x",
        "n": 3,
    }
    masked = mask(value)
    assert PASSWORD not in repr(masked)
    assert masked["redis"]["password"] == MASK
    assert masked["redis"]["db"] == 0
    assert masked["redis_key"] == "asteroid:c:profile:x"  # a key, not a secret
    assert masked["n"] == 3
    error = mask(redis.ConnectionError(f"cannot reach {_dead_url()}"))
    assert isinstance(error, str)
    assert PASSWORD not in error
    assert error.startswith("ConnectionError: cannot reach redis://trainer:***@")
    plain = ValueError("nothing secret")
    assert mask(plain) is plain


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("password", True),
        ("redis_password", True),
        ("ACCESS_TOKEN", True),
        ("client-secret", True),
        ("api_key", True),
        ("redis_key", False),
        ("host", False),
        ("username", False),
    ],
)
def test_secret_keys_are_recognised(name: str, secret: bool) -> None:
    assert is_secret_key(name) is secret


def test_settings_show_the_redis_url_masked_but_keep_it_for_connecting() -> None:
    url = _dead_url()
    settings = CoordinatorSettings(redis_url=url)
    assert PASSWORD not in repr(settings)
    assert PASSWORD not in str(settings)
    assert f"{USER}:{MASK}@" in repr(settings)
    assert settings.redis_url == url
    assert CommonSettings(redis_url=url).redis_url == url


def test_store_ping_error_names_the_redis_without_its_password() -> None:
    url = _dead_url()
    store = Store(url, "secrets-test")
    try:
        with pytest.raises(StoreError) as caught:
            store.ping()
    finally:
        store.close()
    message = str(caught.value)
    assert PASSWORD not in message
    assert mask_url(url) in message
    assert "does not answer" in message


# --- the log processor -----------------------------------------------------------


def _log_lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    err = capsys.readouterr().err
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_processor_masks_every_value_of_an_event() -> None:
    event = {
        "event": f"connecting to {_dead_url()}",
        "password": PASSWORD,
        "kwargs": {"host": "h", "password": PASSWORD},
        "settings": CoordinatorSettings(redis_url=_dead_url()),
        "error": redis.AuthenticationError(f"refused for {_dead_url()}"),
        "round": 4,
    }
    out = mask_secrets(None, "error", event)
    assert PASSWORD not in repr(out)
    assert out["password"] == MASK
    assert out["round"] == 4


def test_every_logged_line_is_masked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # configure_logging installs masking exception hooks; put the originals back afterwards
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    configure_logging("info", "json", redis_url=_dead_url())
    log = get_logger("secrets-test")
    url = _dead_url()
    log.info(f"using {url}", kwargs=redis.Redis.from_url(url).connection_pool.connection_kwargs)
    log.warning("retrying", error=redis.ConnectionError(f"Error 111 connecting to {url}"))
    try:
        raise StoreError(f"Redis at {{'password': '{PASSWORD}'}} does not answer")
    except StoreError:
        log.exception("failed")
    structlog.reset_defaults()
    lines = _log_lines(capsys)
    assert len(lines) == 3
    assert PASSWORD not in json.dumps(lines)
    assert all(MASK in json.dumps(line) for line in lines)
    assert "StoreError" in str(lines[2]["exception"])  # the traceback is kept, masked


def test_uncaught_exception_tracebacks_are_masked(tmp_path: Path) -> None:
    script = (
        "import threading\n"
        "from common.logging import configure_logging\n"
        "configure_logging('info', 'json')\n"
        "def receiver():\n"
        f"    raise ConnectionError('receiver lost {_dead_url()}')\n"
        "t = threading.Thread(target=receiver, name='receiver')\n"
        "t.start()\n"
        "t.join()\n"
        f"raise RuntimeError('cannot reach {_dead_url()}')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert proc.returncode == 1
    assert "Exception in thread receiver:" in proc.stderr
    assert "ConnectionError: receiver lost redis://trainer:***@127.0.0.1" in proc.stderr
    assert "RuntimeError: cannot reach redis://trainer:***@127.0.0.1" in proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr


# --- real processes against a Redis that does not answer -------------------------


@pytest.fixture
def dead(tmp_path: Path, cluster_name: str) -> Iterator[tuple[LocalCluster, str]]:
    """Children whose ASTEROID_REDIS_URL has a password and points where nothing listens."""
    url = _dead_url()
    c = LocalCluster(tmp_path, url, cluster_name)
    c.env["COLUMNS"] = "500"  # rich must not wrap a leaked password out of sight
    yield c, url
    c.close()


def _output(c: LocalCluster, name: str) -> str:
    out = c.log(name)
    assert PASSWORD not in out, f"{name} showed the Redis password:\n{out}"
    return out


@pytest.mark.integration
@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--job", "j1"],
        ["export", "j1", "--out", "weights.safetensors"],
    ],
    ids=["status", "status-job", "export"],
)
def test_cli_says_redis_is_unreachable_without_the_password(
    dead: tuple[LocalCluster, str], args: list[str]
) -> None:
    c, url = dead
    c.spawn("cli", ["-m", "services.cli", *args, "--redis-url", url])
    code = c.wait("cli", 60)
    out = _output(c, "cli")
    assert code != ExitCode.OK
    assert f"error: Redis at {mask_url(url)} does not answer" in out
    assert "Traceback" not in out


@pytest.mark.integration
def test_cli_plan_from_redis_says_redis_is_unreachable(dead: tuple[LocalCluster, str]) -> None:
    c, _ = dead
    spec = c.write(
        "cluster.yaml",
        {"devices": [{"name": "a", "profile": "p", "memory_bytes": 1 << 30}]},
    )
    sizes = ["--global-batch", "8", "--microbatches", "2"]
    c.spawn("plan", ["-m", "services.cli", "plan", "--cluster", str(spec), *sizes])
    code = c.wait("plan", 60)
    out = _output(c, "plan")
    assert code == ExitCode.UNREACHABLE, out
    assert "does not answer" in out
    assert "Traceback" not in out


@pytest.mark.integration
def test_profiler_reports_unreachable_redis_without_the_password(
    dead: tuple[LocalCluster, str],
) -> None:
    c, url = dead
    quick = ["--batch-sizes", "1", "--repeats", "1", "--warmup", "0"]
    c.spawn("profiler", ["-m", "services.profiler.main", "--model", "mlp", *quick])
    code = c.wait("profiler", 120)
    out = _output(c, "profiler")
    assert code == ExitCode.UNREACHABLE, out
    errors = [e for e in c.log_events("profiler") if e.get("event") == "profiling failed"]
    assert errors, out
    assert f"Redis at {mask_url(url)} does not answer" in str(errors[0]["error"])


@pytest.mark.integration
def test_coordinator_refuses_to_start_without_redis_and_hides_the_password(
    dead: tuple[LocalCluster, str],
) -> None:
    c, url = dead
    job = {
        "job_id": "secrets-job",
        "model": {"name": "mlp", "options": {"hidden": 16, "depth": 2}},
        "seed": 1,
        "rounds": 1,
        "dataset": {"kind": "synthetic", "eval_size": 8},
    }
    c.spawn(
        "coordinator",
        ["-m", "services.coordinator.main", "--bind", c.addr, "--job", str(c.write("j.yaml", job))],
    )
    code = c.wait("coordinator", 60)
    out = _output(c, "coordinator")
    assert code == ExitCode.REDIS_UNAVAILABLE, out
    errors = [
        e for e in c.log_events("coordinator") if e.get("event") == "coordinator cannot start"
    ]
    assert errors, out
    assert f"Redis at {mask_url(url)} does not answer" in str(errors[0]["error"])
    assert "Traceback" not in out


@pytest.mark.integration
def test_status_masks_a_recorded_job_error_that_quotes_a_url(
    tmp_path: Path, redis_url: str, cluster_name: str
) -> None:
    # a worker's error text is stored with the job and shown by status as it is
    store = Store(redis_url, cluster_name)
    try:
        store.set_fields(
            {"state": "failed", "error": f"no store {_dead_url()}", "round": 1}, "job", "leaky"
        )
    finally:
        store.close()
    c = LocalCluster(tmp_path, redis_url, cluster_name)
    c.env["COLUMNS"] = "500"
    try:
        c.spawn("status", ["-m", "services.cli", "status", "--job", "leaky"])
        code = c.wait("status", 60)
        out = _output(c, "status")
    finally:
        c.close()
    assert code == ExitCode.OK, out
    assert f"no store redis://{USER}:{MASK}@127.0.0.1" in out


@pytest.mark.integration
def test_status_hides_a_password_given_as_a_url_parameter(dead: tuple[LocalCluster, str]) -> None:
    c, _ = dead
    url = f"redis://127.0.0.1:{free_port()}/0?password={PASSWORD}"
    c.spawn("cli", ["-m", "services.cli", "status", "--redis-url", url])
    code = c.wait("cli", 60)
    out = _output(c, "cli")
    assert code == ExitCode.UNREACHABLE, out
    assert mask_url(url).endswith(f"/0?password={MASK}")
    assert f"error: Redis at {mask_url(url)} does not answer" in out
