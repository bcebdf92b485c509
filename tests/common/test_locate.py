"""Devices learn where Redis is from the coordinator, and never a password that way.

Pure parts (what the coordinator answers for its URL, the URL a device builds,
the key set's password files) are checked directly; the request and reply go
over real ZeroMQ sockets to an in-process coordinator, with CURVE keys of every
role that may ask and one that is not in the set.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from common.codec import encode
from common.curve import CurveKeys, create_key_set
from common.errors import ConfigError
from common.locate import (
    CoordinatorUnreachable,
    coordinator_host,
    locate,
    location_of,
    password_file,
    read_password,
    redis_url_for,
    with_redis,
)
from common.messages import RedisLocation, message_adapter
from common.settings import CoordinatorSettings, WorkerSettings
from services.coordinator.service import Coordinator

# --- pure parts ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://192.168.1.10:5555", "192.168.1.10"),
        ("tcp://coord.lan:5555", "coord.lan"),
        ("tcp://[fe80::1]:5555", "fe80::1"),
    ],
)
def test_the_coordinators_host_comes_from_its_address(address: str, host: str) -> None:
    assert coordinator_host(address) == host


@pytest.mark.parametrize("address", ["192.168.1.10:5555", "ipc:///tmp/x", "tcp://host", "tcp://:1"])
def test_an_address_without_tcp_host_and_port_is_refused(address: str) -> None:
    with pytest.raises(ConfigError, match="is not tcp://HOST:PORT"):
        coordinator_host(address)


def test_a_loopback_redis_is_named_by_an_empty_host_and_no_credential_is_told() -> None:
    loc = location_of("redis://coordinator:s3cret@127.0.0.1:6380/2", "lab", nonce=5)
    assert (loc.nonce, loc.host, loc.port, loc.db, loc.tls, loc.cluster, loc.error) == (
        5,
        "",
        6380,
        2,
        False,
        "lab",
        "",
    )
    wire = b"".join(bytes(f) for f in encode(loc, "coordinator"))
    assert b"s3cret" not in wire
    assert b"coordinator:" not in wire  # not even the coordinator's Redis user


def test_a_redis_on_the_network_is_named_with_tls_when_its_url_says_so() -> None:
    loc = location_of("rediss://state.lan:6390/0", "default", nonce=1)
    assert (loc.host, loc.port, loc.db, loc.tls) == ("state.lan", 6390, 0, True)


def test_a_unix_socket_cannot_be_told_to_another_machine() -> None:
    loc = location_of("unix:///run/redis.sock", "default", nonce=1)
    assert "Unix socket" in loc.error


def test_a_cluster_name_devices_cannot_be_told_is_an_error_answer() -> None:
    loc = location_of("redis://127.0.0.1:6379/0", "no spaces please", nonce=1)
    assert "cannot be told" in loc.error


def test_the_location_message_is_strict() -> None:
    good = {"type": "redis_location", "nonce": 1, "host": "h", "port": 1, "cluster": "c"}
    assert isinstance(message_adapter.validate_python(good), RedisLocation)
    for bad in (
        {**good, "password": "x"},
        {**good, "port": 0},
        {**good, "port": 65536},
        {**good, "host": "a b"},
        {**good, "host": "h/../x"},
        {**good, "cluster": "*"},
        {**good, "nonce": -1},
    ):
        with pytest.raises(ValidationError):
            message_adapter.validate_python(bad)


def test_a_device_builds_its_url_from_the_location_and_its_own_password() -> None:
    loc = RedisLocation(nonce=1, host="", port=6380, db=3, cluster="c")
    assert redis_url_for(loc, "tcp://10.0.0.2:5555", "worker", None) == "redis://10.0.0.2:6380/3"
    url = redis_url_for(loc, "tcp://[fe80::2]:5555", "worker", "p@ss:w/rd")
    assert url == "redis://worker:p%40ss%3Aw%2Frd@[fe80::2]:6380/3"
    remote = RedisLocation(nonce=1, host="state.lan", port=6379, tls=True, cluster="c")
    assert redis_url_for(remote, "tcp://10.0.0.2:5555", "operator", "pw") == (
        "rediss://operator:pw@state.lan:6379/0"
    )


def test_a_key_set_gives_each_role_its_own_password(tmp_path: Path) -> None:
    assert read_password(None, "worker") is None
    assert read_password(tmp_path, "worker") is None  # no file: no password
    path = password_file(tmp_path, "worker")
    path.parent.mkdir()
    path.write_text("hunter2\n")
    path.chmod(0o600)
    assert read_password(tmp_path, "worker") == "hunter2"
    assert read_password(tmp_path, "profiler") is None


@pytest.mark.parametrize("content", ["", "\n", "two\nlines", "tab\tinside", "x" * 600])
def test_a_password_file_that_is_not_one_password_is_refused(tmp_path: Path, content: str) -> None:
    path = password_file(tmp_path, "worker")
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(ConfigError, match=str(path)):
        read_password(tmp_path, "worker")


def test_a_configured_redis_url_is_kept_and_nothing_is_asked() -> None:
    settings = WorkerSettings(redis_url="redis://elsewhere:1/0", coordinator="tcp://127.0.0.1:9")
    assert with_redis(settings, None, "worker", patience_s=0.1) is settings


# --- over real sockets, to a coordinator ---------------------------------------------


@pytest.fixture
def keyset(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    create_key_set(root, workers=["w1"], services=["profiler-a"], operators=["alice"])
    return root


@pytest.fixture
def coordinator(keyset: Path, redis_url: str, cluster_name: str) -> Iterator[Coordinator]:
    """A real coordinator with CURVE on loopback, its socket served by a thread."""
    settings = CoordinatorSettings(
        bind="tcp://127.0.0.1:0", keys=keyset, redis_url=redis_url, cluster=cluster_name
    )
    coord = Coordinator(settings)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            coord.pump(0.05)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield coord
    finally:
        stop.set()
        thread.join(10)
        coord.close()


@pytest.mark.parametrize(
    ("role", "name"), [("worker", "w1"), ("service", None), ("operator", None)]
)
def test_every_role_of_the_set_learns_where_redis_is(
    coordinator: Coordinator, keyset: Path, role: str, name: str | None
) -> None:
    keys = CurveKeys.load(keyset, role, name)
    loc = locate(coordinator.endpoint, keys, patience_s=20)
    want = location_of(coordinator.settings.redis_url, coordinator.settings.cluster, loc.nonce)
    assert loc == want
    assert loc.cluster == coordinator.settings.cluster


def test_a_device_given_only_the_coordinator_gets_a_url_with_its_key_sets_password(
    coordinator: Coordinator, keyset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASTEROID_REDIS_URL", raising=False)
    monkeypatch.delenv("ASTEROID_CLUSTER", raising=False)
    password = secrets.token_hex(8)
    path = password_file(keyset, "worker")
    path.parent.mkdir()
    path.write_text(password)
    path.chmod(0o600)
    settings = WorkerSettings(coordinator=coordinator.endpoint, keys=keyset)
    got = with_redis(settings, CurveKeys.load(keyset, "worker"), "worker", patience_s=20)
    loc = location_of(coordinator.settings.redis_url, "x", 0)
    assert got.redis_url == redis_url_for(loc, coordinator.endpoint, "worker", password)
    assert got.cluster == coordinator.settings.cluster
    assert f"worker:{password}@" in got.redis_url


def test_a_key_outside_the_set_learns_nothing(coordinator: Coordinator, tmp_path: Path) -> None:
    stranger = tmp_path / "other"
    create_key_set(stranger, workers=["w1"])
    keys = CurveKeys.load(stranger, "worker")
    # the stranger's set has its own coordinator key: give it the real one, as an attacker would
    real = coordinator.settings.keys
    assert real is not None
    (stranger / "coordinator" / "coordinator.key").write_bytes(
        (real / "coordinator" / "coordinator.key").read_bytes()
    )
    with pytest.raises(CoordinatorUnreachable, match="no coordinator answered"):
        locate(coordinator.endpoint, keys, patience_s=2, attempt_s=1)
