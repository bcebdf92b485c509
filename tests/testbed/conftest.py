"""Fixtures of the testbed tests: root and namespace checks, a free subnet, a unique tag.

Integration tests build real namespaces, links and cgroups, so they need root
and a kernel that allows them; elsewhere they skip with the reason. In CI
(CI=true) running as root they must run: a reason to skip there is a broken
machine, so it fails the test instead of hiding it. Every
test's testbed has a tag of its own and is removed by tag afterwards, even
when the test failed before its own cleanup ran.
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
from collections.abc import Iterator

import pytest

from services.testbed.cgroups import CgroupError, hierarchies
from services.testbed.net import NetError, overlaps
from services.testbed.survey import cleanup_leftovers, find


def _unavailable() -> str | None:
    """Why the integration tests cannot run here, None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    probe = f"aeprobe{secrets.token_hex(3)}"  # not a testbed name: `down` would not touch it
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    try:
        hierarchies()
    except CgroupError as exc:
        return str(exc)
    return None


def must_run(ci: str | None, euid: int) -> bool:
    """Whether a testbed test may not skip: in CI (CI=true) with root's privilege."""
    return (ci or "").strip().lower() in ("true", "1", "yes") and euid == 0


def skip_or_fail(reason: str) -> None:
    """Skip with `reason`, except where `must_run` holds: there the test fails with it."""
    if must_run(os.environ.get("CI"), os.geteuid()):
        pytest.fail(f"CI=true as root, so testbed tests must run, but: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def testbed_host() -> None:
    reason = _unavailable()
    if reason:
        skip_or_fail(reason)


@pytest.fixture
def subnet(testbed_host: None) -> str:
    """A /24 in 10.77.0.0/16 that nothing on this machine uses."""
    for third in random.sample(range(100, 250), 150):
        net = f"10.77.{third}.0/24"
        try:
            if not overlaps(net):
                return net
        except NetError:
            break
    skip_or_fail("no free 10.77.x.0/24 subnet")
    raise AssertionError  # unreachable


@pytest.fixture
def tag(testbed_host: None) -> Iterator[str]:
    """A tag only this test uses; whatever carries it is removed after the test.

    It starts with "t", which the hex tags of real runs never do, so a test's
    cleanup cannot touch a testbed someone else is running.
    """
    tag = "t" + secrets.token_hex(2) + random.choice("ghijk")
    yield tag
    left = find(tag).get(tag)
    if left is not None:
        cleanup_leftovers(tag)
