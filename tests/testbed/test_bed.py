"""Real namespaces, links and cgroups: reachability, shaped rates, CPU quotas, faults, cleanup.

Only the network and cgroups are built (`up(services=False)`); small standard
library programs (`_probe.py`) run inside the devices.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import AsteroidError
from services.testbed import net
from services.testbed.bed import ServiceDied, Testbed
from services.testbed.cgroups import DeviceCgroup
from services.testbed.spec import TestbedSpec
from services.testbed.survey import cleanup_leftovers, status
from tests.testbed.traces import alive, descendants, traces

pytestmark = pytest.mark.integration

PROBE = str(Path(__file__).with_name("_probe.py"))
MiB = 1 << 20
SEEN_LIMITS = (
    "from common.device import cgroup_memory_limit, cpu_quota\n"
    "print(cpu_quota(), cgroup_memory_limit())"
)


def make_spec(
    subnet: str, bandwidth: float = 1e8, cpu: float = 0.5, **extra: object
) -> TestbedSpec:
    devices = [
        {"name": n, "cpu": cpu, "memory_bytes": 256 * MiB, "bandwidth_bps": bandwidth, **extra}
        for n in ("dev-a", "dev-b")
    ]
    return TestbedSpec.model_validate({"name": "t", "subnet": subnet, "devices": devices})


def wait_listening(tb: Testbed, name: str) -> None:
    """Until the probe started as `name` printed "listening" (it binds before printing)."""
    log = tb.log_dir / f"{name}.log"
    for _ in range(200):
        if log.exists() and "listening" in log.read_text():
            return
        tb.check()
        time.sleep(0.05)
    raise AssertionError(f"{name} never listened: {tb.tail(name)}")


def probe(*args: object) -> list[str]:
    return [sys.executable, PROBE, *map(str, args)]


def test_devices_reach_each_other_and_the_host_but_nothing_else(tmp_path, subnet, tag):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        a, b = tb.address("dev-a"), tb.address("dev-b")
        tb.start("dev-b", "echo-b", probe("echo", b, 7000))
        tb.start("dev-a", "echo-a", probe("echo", a, 7000))
        wait_listening(tb, "echo-b")
        wait_listening(tb, "echo-a")
        assert tb.run("dev-a", probe("ask", b, 7000, 5)).stdout.strip() == "HELLO"
        assert tb.run("dev-b", probe("ask", a, 7000, 5)).stdout.strip() == "HELLO"
        # the host side (where the services listen) reaches the devices over the bridge
        host = subprocess.run(probe("ask", a, 7000, 5), capture_output=True, text=True)
        assert host.stdout.strip() == "HELLO"
        # each device is its own host, inside its own cgroups
        who = tb.run("dev-a", probe("whoami")).stdout
        assert who.splitlines()[0] == "dev-a"
        assert f"asteroid-testbed/{tag}/dev-a/worker" in who
        # ... whose limits the services find where they look for them
        limits = tb.run("dev-a", [sys.executable, "-c", SEEN_LIMITS])
        assert limits.stdout.split() == ["0.5", str(256 * MiB)], limits.stderr
        # no route leaves the subnet (asked of the routing table: nothing is sent)
        route = subprocess.run(
            ["ip", "-n", tb.netns("dev-a"), "route", "get", "192.0.2.1"],
            capture_output=True,
            text=True,
        )
        assert route.returncode != 0 and "unreachable" in route.stderr.lower()
        shown = status(tag)[tag]
        assert [d.name for d in shown] == ["dev-a", "dev-b"]
        assert shown[0].address == f"{a}/24"
        assert shown[0].uplink.startswith("100Mbit") and shown[0].downlink.startswith("100Mbit")
        assert shown[0].cpu == pytest.approx(0.5) and shown[0].memory_limit == 256 * MiB
    assert traces(tag) == []


@pytest.mark.parametrize("bandwidth", [100e6, 20e6], ids=["100mbit", "20mbit"])
def test_bulk_transfer_runs_at_the_shaped_rate(tmp_path, subnet, tag, bandwidth):
    with Testbed(make_spec(subnet, bandwidth), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        b = tb.address("dev-b")
        server = tb.start("dev-b", "sink", probe("server", b, 7001))
        wait_listening(tb, "sink")
        sent = tb.run("dev-a", probe("send", b, 7001, 4), timeout_s=60)
        assert sent.returncode == 0, sent.stderr
        assert server.wait(timeout=30) == 0
        bits_per_s, total = map(float, (tmp_path / "sink.log").read_text().split()[-2:])
    # TCP goodput: 1448 payload bytes per 1514-byte frame on the wire, 95.6% of the rate
    assert bits_per_s == pytest.approx(bandwidth, rel=0.10), (bits_per_s, total)
    assert traces(tag) == []


def test_cpu_quota_gives_the_share_and_slow_changes_it(tmp_path, subnet, tag):
    with Testbed(make_spec(subnet, cpu=0.5), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        share = float(tb.run("dev-a", probe("burn", 3)).stdout)
        assert 0.35 < share < 0.6
        tb.slow("dev-a", 0.2)
        slowed = float(tb.run("dev-a", probe("burn", 3)).stdout)
        assert 0.1 < slowed < 0.3
        assert tb.cgroup("dev-a").cpu() == pytest.approx(0.2)


def test_memory_limit_kills_a_hog_and_counts_it(tmp_path, subnet, tag):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        fits = tb.run("dev-a", probe("hog", 64))
        assert fits.stdout.strip() == "survived"
        assert tb.peak_memory("dev-a") >= 64 * MiB
        assert tb.oom_kills("dev-a") == 0
        hog = tb.run("dev-a", probe("hog", 400))
        assert hog.returncode == -9 and "survived" not in hog.stdout
        assert tb.oom_kills("dev-a") == 1
        assert tb.peak_memory("dev-a") <= 256 * MiB


def test_cut_heal_pause_resume_kill(tmp_path, subnet, tag):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        b = tb.address("dev-b")
        echo = tb.start("dev-b", "echo", probe("echo", b, 7002))
        wait_listening(tb, "echo")
        tb.cut("dev-b")
        assert "CUT" in status(tag)[tag][1].uplink
        assert tb.run("dev-a", probe("ask", b, 7002, 1)).stdout.strip() == "unreachable"
        tb.heal("dev-b")
        assert tb.run("dev-a", probe("ask", b, 7002, 5)).stdout.strip() == "HELLO"
        tb.pause("dev-b")
        assert tb.cgroup("dev-b").frozen()
        assert tb.run("dev-a", probe("ask", b, 7002, 1)).stdout.strip() == "unreachable"
        tb.resume("dev-b")
        assert tb.run("dev-a", probe("ask", b, 7002, 5)).stdout.strip() == "HELLO"
        tb.kill("dev-b")
        assert echo.poll() == -9
        assert tb.cgroup("dev-b").pids() == []
        tb.check()  # a device killed on purpose is not a service that died


def test_a_dead_process_is_reported_with_its_log(tmp_path, subnet, tag):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        proc = tb.start("dev-a", "broken", [sys.executable, "-c", "raise SystemExit('gone')"])
        proc.wait(timeout=30)
        with pytest.raises(ServiceDied, match=r"broken exited with code 1:\n.*gone"):
            tb.check()


def test_down_removes_everything_even_when_the_body_raises(tmp_path, subnet, tag):
    pids = []
    with (
        pytest.raises(RuntimeError, match="test body failed"),
        Testbed(make_spec(subnet), tmp_path, tag=tag) as tb,
    ):
        tb.up(services=False)
        pids.append(tb.start("dev-a", "sleeper", ["sleep", "600"]).pid)
        pids.append(tb.start("dev-b", "frozen", ["sleep", "600"]).pid)
        tb.pause("dev-b")  # frozen processes cannot act on signals until thawed
        with pytest.raises(AsteroidError, match="paused"):
            tb.start("dev-b", "late", ["sleep", "600"])
        assert traces(tag)
        raise RuntimeError("test body failed")
    assert traces(tag) == []
    assert not any(alive(p) for p in pids)


def test_up_refuses_a_subnet_in_use_and_leaves_nothing(tmp_path, subnet, tag):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as first:
        first.up(services=False)
        other = tag[:-1] + ("x" if tag[-1] != "x" else "y")
        try:
            with pytest.raises(Exception, match="already in use"):
                Testbed(make_spec(subnet), tmp_path, tag=other).up(services=False)
            assert traces(other) == []
        finally:
            cleanup_leftovers(other)


def test_cleanup_leftovers_removes_a_half_created_testbed(tmp_path, subnet, tag):
    # what a run SIGKILLed half-way through `up` leaves: a bridge, one device's
    # namespace and link, its cgroup, a process inside, and no Testbed object
    net.run_all(net.bridge_commands(tag, subnet, subnet.replace(".0/24", ".1")))
    net.run_all(net.device_commands(tag, 0, "dev-a", subnet, subnet.replace(".0/24", ".10")))
    DeviceCgroup(tag, "dev-a").create(0.3, 256 * MiB)
    DeviceCgroup(tag, "dev-b").create(0.3, 256 * MiB)
    sleeper = subprocess.Popen(
        ["ip", "netns", "exec", net.netns_name(tag, "dev-a"), "sleep", "600"],
        start_new_session=True,
    )
    assert len(traces(tag)) >= 5
    removed = cleanup_leftovers(tag)
    assert sleeper.wait(timeout=10) == -9
    text = "\n".join(removed)
    for what in (
        f"process {sleeper.pid}",
        f"namespace ae-{tag}-dev-a",
        f"link aebr-{tag}",
        "cgroup",
    ):
        assert what in text, text
    assert traces(tag) == []
    assert cleanup_leftovers(tag) == []


def test_a_cgroup_takes_a_running_process_and_removal_kills_it(testbed_host, tag):
    cg = DeviceCgroup(tag, "solo")
    cg.create(0.2, 128 * MiB, roles=("worker",))
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        cg.attach(sleeper.pid)
        assert (
            f"asteroid-testbed/{tag}/solo/worker" in Path(f"/proc/{sleeper.pid}/cgroup").read_text()
        )
        assert cg.pids() == [sleeper.pid]
        cg.freeze()
        cg.remove()  # kills (thawing first), then removes every directory
        assert sleeper.wait(timeout=10) == -9
        assert traces(tag) == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sigint_to_the_cli_while_it_starts_removes_everything(tmp_path, subnet, tag):
    bed = tmp_path / "bed.yaml"
    bed.write_text(
        f"name: sig\nsubnet: {subnet}\ndevices:\n"
        "  - {name: only, cpu: 0.3, memory_bytes: 512MiB, bandwidth_bps: 100mbit}\n"
    )
    logs = tmp_path / "logs"
    args = ["testbed", "up", "--file", str(bed), "--tag", tag, "--logs", str(logs)]
    cli = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(600):  # until the device's worker runs: mid-way through `up`
            if (logs / "only.worker.log").exists() or cli.poll() is not None:
                break
            time.sleep(0.05)
        assert cli.poll() is None, cli.stdout.read() if cli.stdout else ""
        started = descendants(cli.pid)
        assert started
        cli.send_signal(signal.SIGINT)
        out, _ = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
        out = cli.communicate()[0] if cli.stdout and not cli.stdout.closed else out
    assert cli.returncode == 130, out
    assert "interrupted" in out
    assert traces(tag) == []
    assert not any(alive(p) for p in started)
