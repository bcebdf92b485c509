"""The testbed works on a host whose iptables FORWARD policy drops, as Docker leaves it.

Docker loads br_netfilter (bridged frames then cross iptables) and sets the
FORWARD policy to DROP, which cuts the testbed's devices off from each other
unless the testbed accepts its own bridge's traffic. The test sets that host
up itself (and puts the policy back afterwards), shows that devices talk with
the testbed's rule, that they do not without it (so the rule is what makes
the difference), and that `down` removes the rule.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.testbed import net
from services.testbed.bed import Testbed
from tests.testbed.conftest import skip_or_fail
from tests.testbed.test_bed import make_spec, probe, wait_listening
from tests.testbed.traces import traces

pytestmark = pytest.mark.integration

BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")


def _iptables(*args: str) -> str:
    done = subprocess.run(["iptables", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"iptables {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


@pytest.fixture
def forward_drop(testbed_host: None) -> Iterator[None]:
    """FORWARD policy DROP with bridged frames filtered; what was there before comes back."""
    if shutil.which("iptables") is None:
        skip_or_fail("iptables is not installed")
    if not BRIDGE_NF.exists():
        subprocess.run(["modprobe", "br_netfilter"], capture_output=True, timeout=30)
    if not BRIDGE_NF.exists():
        skip_or_fail("br_netfilter is not available: bridged frames never cross iptables here")
    policy = "DROP" if "-P FORWARD DROP" in _iptables("-S", "FORWARD") else "ACCEPT"
    bridge_nf = BRIDGE_NF.read_text().strip()
    try:
        BRIDGE_NF.write_text("1")
        _iptables("-P", "FORWARD", "DROP")
        yield
    finally:
        _iptables("-P", "FORWARD", policy)
        BRIDGE_NF.write_text(bridge_nf)


def _a_asks_b(tb: Testbed) -> str:
    b = tb.address("dev-b")
    tb.start("dev-b", "echo-b", probe("echo", b, 7000))
    wait_listening(tb, "echo-b")
    return tb.run("dev-a", probe("ask", b, 7000, 3), timeout_s=30).stdout.strip()


def test_devices_reach_each_other_under_a_dropping_forward_policy(
    tmp_path, subnet, tag, forward_drop
):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        assert tag in net.list_forward_rules()
        assert _a_asks_b(tb) == "HELLO"
    assert traces(tag) == []  # the rule included


def test_without_its_rule_the_same_testbed_is_cut_off(tmp_path, subnet, tag, forward_drop):
    with Testbed(make_spec(subnet), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        _iptables("-D", *net.forward_rule(tag))
        assert tag not in net.list_forward_rules()
        assert _a_asks_b(tb) == "unreachable"
    assert traces(tag) == []
