"""Shared fixtures: seeded torch, a real Redis, and guaranteed cleanup of processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
import structlog
import torch

from tests.cluster import kill_all

REDIS_URL = os.environ.get("ASTEROID_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield
    # services configure structlog for their process; in-process runs must not leak
    # that configuration (and its captured stream) into later tests
    structlog.reset_defaults()


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    kill_all()


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(f"tests need a Redis at {REDIS_URL} (set ASTEROID_TEST_REDIS_URL): {exc}")
    return REDIS_URL


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
