"""Fixtures of the compose tests: a Docker engine, and the whole cluster in containers.

Without an engine, docker-compose or the images (`make images`) the tests skip
with the reason; in CI (CI=true) they must run, so the same reason fails them.
The stack is brought up once per module under a unique project name and is
always taken down with its volumes; the teardown then asserts that the engine
holds no container, network or volume of the project.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import redis

from tests.compose.stack import WORKERS, ComposeStack, engine_missing

STARTUP_S = 240.0
"""Longest wait for every healthcheck: eight Python services import torch on a few cores."""
JOINED_S = 60.0
"""Longest further wait for every worker's first heartbeat to reach Redis."""


def must_run(ci: str | None) -> bool:
    """Whether an environment reason may not skip the compose tests (CI=true)."""
    return (ci or "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="session")
def docker_engine() -> None:
    """Skip (fail in CI) unless the engine, docker-compose and the images are there."""
    reason = engine_missing()
    if reason is None:
        return
    if must_run(os.environ.get("CI")):
        pytest.fail(f"CI=true, so the compose tests must run, but: {reason}")
    pytest.skip(reason)


def _wait_workers(stack: ComposeStack, timeout_s: float) -> None:
    """Until Redis lists every worker as heard from (as the operator reads it)."""
    client = redis.Redis.from_url(stack.redis_url("operator"), socket_timeout=5)
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    try:
        while time.monotonic() < deadline:
            keys = client.scan_iter(match=f"asteroid:{stack.cluster}:device:*", count=100)
            seen = {k.decode().rsplit(":", 1)[-1] for k in keys}
            if set(WORKERS) <= seen:
                return
            time.sleep(1)
    finally:
        client.close()
    raise AssertionError(f"workers in Redis after {timeout_s:.0f} s: {sorted(seen)}")


@pytest.fixture(scope="module")
def stack(docker_engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    """deploy/compose.yaml up and healthy, every worker joined; removed without a trace after."""
    stack = ComposeStack(tmp_path_factory.mktemp("compose"))
    stack.make_keys()
    try:
        stack.compose("up", "-d", timeout_s=STARTUP_S)
        stack.wait_healthy(STARTUP_S)
        _wait_workers(stack, JOINED_S)
        yield stack
    finally:
        try:
            stack.down()
        finally:
            left = stack.leftovers()
            assert not any(left.values()), f"project {stack.project} left {left}"
