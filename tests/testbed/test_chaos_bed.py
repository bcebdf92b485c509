"""The chaos testbed's faults on real namespaces: a link down and up, Redis and the coordinator
killed and started again, a spare device switched on, a worker stopped and continued.

The link test builds only the network (probes inside the devices); the services
test starts Redis (with its append-only file), the coordinator and the planner,
and one spare device that joins.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from common.errors import ConfigError
from services.testbed import net
from services.testbed.chaos import ChaosTestbed
from tests.testbed.test_bed import make_spec, probe, wait_listening
from tests.testbed.traces import alive, traces

pytestmark = pytest.mark.integration


def test_link_state_commands_name_the_device_end() -> None:
    assert net.link_state_commands("ae-t1-a", up=False) == [
        ["ip", "-n", "ae-t1-a", "link", "set", "eth0", "down"]
    ]
    assert net.link_state_commands("ae-t1-a", up=True)[0][-1] == "up"


def test_a_link_down_cuts_the_device_off_and_up_brings_it_back(tmp_path, subnet, tag):
    with ChaosTestbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        b = tb.address("dev-b")
        tb.start("dev-b", "echo", probe("echo", b, 7003))
        wait_listening(tb, "echo")
        assert tb.run("dev-a", probe("ask", b, 7003, 5)).stdout.strip() == "HELLO"
        tb.link_down("dev-b")
        assert not tb.link_is_up("dev-b")
        assert tb.run("dev-a", probe("ask", b, 7003, 1)).stdout.strip() == "unreachable"
        tb.link_up("dev-b")
        assert tb.link_is_up("dev-b")
        # its route comes back with the link: reachable again without any other step
        assert tb.run("dev-a", probe("ask", b, 7003, 10)).stdout.strip() == "HELLO"
    assert traces(tag) == []


def _joined(log: Path, worker: str) -> bool:
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "worker joined" and event.get("worker") == worker:
            return True
    return False


@pytest.mark.timeout(600)
def test_redis_and_coordinator_come_back_and_a_spare_device_joins(tmp_path, subnet, tag):
    spec = make_spec(subnet)
    tb = ChaosTestbed(
        spec, tmp_path / "logs", tag=tag, redis_dir=tmp_path / "redis", spare=["dev-a", "dev-b"]
    )
    pids: list[int] = []
    with tb:
        tb.up(services=True, ready_timeout_s=300)  # no device yet: only the host side
        client = redis.Redis.from_url(tb.redis_url, socket_timeout=5)
        client.set("chaos-key", "kept")
        time.sleep(1.5)  # appendfsync everysec: the write is in the file within a second
        old = tb.redis_pid()
        tb.kill_redis()
        assert tb.redis_pid() is None
        with pytest.raises(redis.ConnectionError):
            client.ping()
        tb.start_redis()
        assert tb.redis_pid() not in (None, old)
        assert client.get("chaos-key") == b"kept"  # loaded from the append-only file
        client.close()

        first = tb.procs["coordinator"].pid
        tb.kill_coordinator()
        tb.check()  # killed on purpose: not a service that died
        tb.restart_coordinator(resume=False)
        assert tb.procs["coordinator"].pid != first

        with pytest.raises(ConfigError):
            tb.join("no-such-device")
        tb.stage("dev-b")  # started with its link down: it cannot reach the coordinator
        assert not tb.link_is_up("dev-b") and tb.staged() == {"dev-b"}
        tb.join("dev-b")  # its link comes up and the running worker joins
        assert tb.link_is_up("dev-b") and tb.staged() == set()
        deadline = time.monotonic() + 300
        while not _joined(tb.log_dir / "coordinator.log", "dev-b"):  # the restarted one
            tb.check()
            assert time.monotonic() < deadline, tb.tail("dev-b.worker")
            time.sleep(0.5)
        tb.sigstop("dev-b")
        tb.sigcont("dev-b")
        tb.check()
        pids = [*tb.pids()]
    assert traces(tag) == []
    assert not any(alive(p) for p in pids)
