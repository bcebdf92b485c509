"""A Redis password is hidden whatever characters it holds.

The attack: a password holding a quote, "<", ">", "/", a space and the like
slipped past the masking patterns (they stopped at those characters), so the
worker's start line and `asteroid status`'s errors printed it. Here the masker
is checked over arbitrary printable passwords, raw and percent-encoded, in
URLs, ``password=`` assignments, redis-py's kwargs reprs and exceptions; then
real processes (a worker, `asteroid status`) run against a real redis-server
that requires such a password, and their output must hold it in no spelling.
A password kept in a file (``--redis-password-file``) stays out of argv.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import redis
from hypothesis import assume, given
from hypothesis import strategies as st

import common.secrets as secrets_module
from common.embedded_redis import redis_server_binary, wait_until_answers
from common.exit_codes import ExitCode
from common.ports import free_port
from common.procs import spawn, stop_all
from common.secrets import MASK, mask, mask_text, mask_url, remember_url
from tests.cluster import LocalCluster, cmdline

HOST = "127.0.0.1:6390"
SHOWN = f"redis://user:{MASK}@{HOST}/0"
"""What any URL below must look like once masked."""

# printable, one line: letters of any script, digits, punctuation, symbols and spaces
PRINTABLE = st.characters(
    categories=["L", "N", "P", "S", "Zs"], exclude_characters="\n\r\x0b\x0c\x85\u2028\u2029"
)
PASSWORDS = st.text(PRINTABLE, min_size=1, max_size=40)
NO_SPACE = st.text(
    st.characters(categories=["L", "N", "P", "S"], exclude_characters="\x85"),
    min_size=1,
    max_size=40,
)


@contextmanager
def nothing_remembered() -> Iterator[None]:
    """Masking by patterns alone: the passwords other tests made this process remember go."""
    saved = set(secrets_module._remembered), secrets_module._remembered_re
    secrets_module._remembered.clear()
    secrets_module._remembered_re = None
    try:
        yield
    finally:
        secrets_module._remembered.clear()
        secrets_module._remembered.update(saved[0])
        secrets_module._remembered_re = saved[1]


def spellings(password: str) -> list[str]:
    """How a leaked password could be written in an output."""
    return [
        password,
        quote(password, safe=""),
        quote(password),
        quote_plus(password),
        repr(password)[1:-1],
        json.dumps(password)[1:-1],
    ]


# --- patterns: the password's place in the text hides it, whatever it holds ----------


@given(password=PASSWORDS, encoded=st.booleans())
def test_a_url_loses_its_password_whatever_it_holds(password: str, encoded: bool) -> None:
    written = quote(password, safe="") if encoded else password
    with nothing_remembered():
        assert mask_url(f"redis://user:{written}@{HOST}/0") == SHOWN
        # a lone token (no user) holding a raw ":" is a user and a password, to redis-py too
        token = quote(password, safe="") if ":" in password else written
        assert mask_url(f"rediss://{token}@{HOST}/0") == f"rediss://{MASK}@{HOST}/0"
        query = f"redis://{HOST}/0?password={quote(password, safe='')}&db=1"
        assert mask_url(query) == f"redis://{HOST}/0?password={MASK}&db=1"


@given(password=NO_SPACE, encoded=st.booleans())
def test_a_url_inside_text_loses_its_password(password: str, encoded: bool) -> None:
    assume(password not in (MASK, "<REDACTED>"))  # shown as they are: already hidden
    written = quote(password, safe="") if encoded else password
    url = f"redis://user:{written}@{HOST}/0"
    with nothing_remembered():
        assert mask_text(f"Redis at {url} does not answer: Error 111.") == (
            f"Redis at {SHOWN} does not answer: Error 111."
        )
        assert mask_text(f"ASTEROID_REDIS_PASSWORD={password} asteroid-worker") == (
            f"ASTEROID_REDIS_PASSWORD={MASK} asteroid-worker"
        )
        shown = mask(redis.ConnectionError(f"cannot reach {url}"))
        assert shown == f"ConnectionError: cannot reach {SHOWN}"
        text = mask_text(repr(ConnectionError(f"cannot reach {url}")))
        assert text in (
            f"ConnectionError('cannot reach {SHOWN}')",
            f'ConnectionError("cannot reach {SHOWN}")',
        )


@given(password=PASSWORDS, encoded=st.booleans())
def test_quoted_urls_kwargs_and_assignments_lose_the_password(password: str, encoded: bool) -> None:
    written = quote(password, safe="") if encoded else password
    url = f"redis://user:{written}@{HOST}/0"
    kwargs = {"username": "user", "password": password, "host": "127.0.0.1", "port": 6390}
    with nothing_remembered():
        quoted = repr(url)
        assert mask_text(f"url={quoted}") == f"url={quoted[0]}{SHOWN}{quoted[0]}"
        assert mask_text(json.dumps({"redis": url})) == json.dumps({"redis": SHOWN})
        assert mask_text(repr(kwargs)) == (
            f"{{'username': 'user', 'password': '{MASK}', 'host': '127.0.0.1', 'port': 6390}}"
        )
        assert mask_text(json.dumps(kwargs)) == (
            f'{{"username": "user", "password": \'{MASK}\', "host": "127.0.0.1", "port": 6390}}'
        )
        assert mask_text(f"connect(host='h', password={password!r}, db=0)") == (
            f"connect(host='h', password={MASK}, db=0)"
        )
        assert mask(kwargs)["password"] == MASK


@pytest.mark.parametrize(
    "unit", ["\\x", "'redis://\\", '"redis://a\\', "'password': '\\", "password='\\"]
)
def test_unclosed_quotes_and_escapes_are_masked_without_backtracking_forever(unit: str) -> None:
    # once exponential in the escapes of an unclosed quoted value (a peer's text in a log
    # line could hang the service): it must simply finish, within pytest's global timeout
    text = f"'password': '{unit * 20_000} redis://u:pw@h/0"
    with nothing_remembered():
        masked = mask_text(text)
    assert masked.endswith(f" redis://u:{MASK}@h/0")
    assert masked.startswith(f"'password': '{MASK}'")


# --- remembered passwords: hidden even in free text -----------------------------------


@given(password=st.text(PRINTABLE.filter(lambda c: c != "*"), min_size=4, max_size=40))
def test_a_remembered_password_is_hidden_in_every_spelling(password: str) -> None:
    with nothing_remembered():
        remember_url(f"redis://user:{quote(password, safe='')}@{HOST}/0")
        for form in [*spellings(password), repr(repr(password))[1:-1]]:
            masked = mask_text(f"\0{form}\0")
            assert password not in masked, (form, masked)
            assert MASK in masked


# --- real processes against a Redis that requires such a password -----------------------


TOKENS = (secrets.token_hex(6), secrets.token_hex(6))
PASSWORD = f"q'{TOKENS[0]}\"<x>@y:z/%q #{TOKENS[1]} w&"
"""The characters that escaped the masking, around two random tokens that must never show."""


def _assert_hidden(out: str, what: str) -> None:
    for needle in [*spellings(PASSWORD), *TOKENS]:
        assert needle not in out, f"{what} showed the Redis password ({needle!r}):\n{out}"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A throwaway redis-server on a free loopback port requiring PASSWORD; always stopped."""
    port = free_port()
    log = tmp_path_factory.mktemp("locked-redis") / "redis.log"
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = spawn([redis_server_binary(), *args], log=log)
    try:
        client = redis.Redis(port=port, socket_connect_timeout=2, socket_timeout=10)
        try:
            assert wait_until_answers(client, proc, 30), log.read_text()
            client.config_set("requirepass", PASSWORD)  # any character, no config quoting
        finally:
            client.close()
        yield port
    finally:
        stop_all([proc])


def _url(port: int, password: str = PASSWORD, user: str = "") -> str:
    return f"redis://{user}:{quote(password, safe='')}@127.0.0.1:{port}/0"


def _wait_for_line(c: LocalCluster, name: str, line: str, timeout_s: float) -> None:
    proc = c.procs[name]
    deadline = time.monotonic() + c.budget.left(timeout_s)
    while line not in c.log(name) and proc.poll() is None:
        assert time.monotonic() < deadline, c.log_tail(name)
        time.sleep(0.1)
    assert line in c.log(name), c.log_tail(name)


@pytest.mark.integration
def test_status_errors_hide_the_password(
    tmp_path: Path, cluster_name: str, locked_redis: int
) -> None:
    urls = {
        "wrong-user": _url(locked_redis, user="intruder"),  # WRONGPASS
        "raw-in-url": f"redis://intruder:{PASSWORD}@127.0.0.1:{locked_redis}/0",  # unparseable
        "query": f"redis://127.0.0.1:{locked_redis}/0?password={quote(PASSWORD, safe='')}&db=9x",
    }
    c = LocalCluster(tmp_path, "redis://127.0.0.1:1/0", cluster_name)
    c.env["COLUMNS"] = "500"  # rich must not wrap a leaked password out of sight
    try:
        for name, url in urls.items():  # side by side: each is a CLI start-up
            c.env["ASTEROID_REDIS_URL"] = url
            c.spawn(name, ["-m", "services.cli", "status"])
        codes = {name: c.wait(name, 60) for name in urls}
    finally:
        c.close()
    for name in urls:
        out = c.log(name)
        _assert_hidden(out, f"asteroid status ({name})")
        # a URL that parses gets no answer (4); one that does not parse is refused (2)
        assert codes[name] in (ExitCode.UNREACHABLE, ExitCode.CONFIG), out
        assert "error: " in out and "Traceback" not in out, out


@pytest.mark.integration
def test_workers_and_status_show_no_password_and_the_documented_way_keeps_it_off_argv(
    tmp_path: Path, cluster_name: str, locked_redis: int
) -> None:
    password_file = tmp_path / "redis.password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    c = LocalCluster(tmp_path, f"redis://127.0.0.1:{locked_redis}/0", cluster_name)
    c.env["COLUMNS"] = "500"
    try:
        # as docs/real-devices.md says: the URL names no password, the file holds it
        worker = ["-m", "services.worker.main", "--device", "w1"]
        c.spawn("w1", [*worker, "--redis-password-file", str(password_file)])
        c.env["ASTEROID_REDIS_PASSWORD_FILE"] = str(password_file)
        c.spawn("status", ["-m", "services.cli", "status"])  # logs in with the file
        # the whole URL in the environment: its start line must not show the password
        c.env.pop("ASTEROID_REDIS_PASSWORD_FILE")
        c.env["ASTEROID_REDIS_URL"] = _url(locked_redis, user="default")
        c.env["ASTEROID_LOG_FORMAT"] = "console"  # the start line as a person reads it
        c.spawn("w2", ["-m", "services.worker.main", "--device", "w2"])
        status_code = c.wait("status", 60)
        _wait_for_line(c, "w1", "worker started", 90)
        argv = cmdline(c.procs["w1"].pid)
        _wait_for_line(c, "w2", "worker started", 90)
    finally:
        c.close()
    assert status_code == ExitCode.OK, c.log("status")
    assert "--redis-password-file" in argv
    _assert_hidden(argv, "the worker's argv")
    for name in ("w1", "w2", "status"):
        _assert_hidden(c.log(name), name)
    assert f"redis://:{MASK}@127.0.0.1:{locked_redis}/0" in c.log("w1")
    assert f"redis://default:{MASK}@127.0.0.1:{locked_redis}/0" in c.log("w2")
