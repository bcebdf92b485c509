"""The ip/tc command builders, without running anything."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from services.testbed import net


def test_names_fit_linux_interface_limits_and_parse_back():
    tag = "abc123"
    assert net.bridge_name(tag) == "aebr-abc123"
    assert net.host_veth(tag, 249) == "aev-abc123-249"
    assert max(len(net.bridge_name(tag)), len(net.host_veth(tag, 999))) <= 15
    assert net.netns_name(tag, "nano-0") == "ae-abc123-nano-0"
    assert net.link_tag("aebr-abc123") == tag
    assert net.link_tag("aev-abc123-7@if2") == tag
    assert net.netns_tag("ae-abc123-nano-0") == tag
    for other in ("eth0", "aebr", "veth123", "ae-bad_tag-x", "aev-abc123-7x", "aetest-a"):
        assert net.link_tag(other) is None
        assert net.netns_tag(other) is None


def test_new_tags_are_valid_and_differ():
    tags = {net.new_tag() for _ in range(50)}
    assert len(tags) > 45
    assert all(net.check_tag(t) == t for t in tags)


@pytest.mark.parametrize("bad", ["", "toolong7", "Upper", "a-b", "a_b"])
def test_bad_tags_are_refused(bad):
    with pytest.raises(ConfigError):
        net.check_tag(bad)


def test_bridge_gets_the_first_address_and_comes_up():
    cmds = net.bridge_commands("t1", "10.77.0.0/24", "10.77.0.1")
    assert cmds == [
        ["ip", "link", "add", "name", "aebr-t1", "type", "bridge"],
        ["ip", "addr", "add", "10.77.0.1/24", "dev", "aebr-t1"],
        ["ip", "link", "set", "aebr-t1", "up"],
    ]


def test_device_gets_a_namespace_a_veth_on_the_bridge_an_address_and_lo():
    cmds = net.device_commands("t1", 2, "nx-0", "10.77.0.0/24", "10.77.0.12")
    assert cmds[0] == ["ip", "netns", "add", "ae-t1-nx-0"]
    assert cmds[1] == [
        "ip", "link", "add", "aev-t1-2", "type", "veth",
        "peer", "name", "eth0", "netns", "ae-t1-nx-0",
    ]  # fmt: skip
    assert ["ip", "link", "set", "aev-t1-2", "master", "aebr-t1"] in cmds
    assert ["ip", "-n", "ae-t1-nx-0", "addr", "add", "10.77.0.12/24", "dev", "eth0"] in cmds
    assert ["ip", "-n", "ae-t1-nx-0", "link", "set", "lo", "up"] in cmds
    # nothing routes out of the subnet: no default route, no other interface
    assert not any("route" in c for c in cmds)


def test_shaping_is_htb_at_the_rate_over_a_fifo_plus_a_dropping_class():
    cmds = net.shaping_commands("eth0", "ae-t1-a", 1e8)
    assert all(c[:3] == ["tc", "-n", "ae-t1-a"] for c in cmds)
    text = [" ".join(c[3:]) for c in cmds]
    assert text[0] == "qdisc add dev eth0 root handle 1: htb default 10"
    assert "classid 1:10 htb rate 100000000bit ceil 100000000bit" in text[1]
    assert text[2].endswith("handle 10: pfifo limit 826")
    assert "classid 1:20 htb" in text[3]
    assert text[4].endswith("handle 20: pfifo limit 0")
    assert "bpf bytecode 1,6 0 0 0 classid 1:20" in text[5]


def test_host_end_shaping_runs_in_the_root_namespace():
    cmds = net.shaping_commands("aev-t1-0", None, 2e7)
    assert all(c[0] == "tc" and "-n" not in c for c in cmds)


def test_latency_uses_netem_only_where_the_kernel_has_it():
    with_netem = net.shaping_commands("eth0", None, 1e8, latency_ms=0.5, netem=True)
    assert with_netem[2][-5:] == ["netem", "delay", "0.5ms", "limit", "826"]
    without = net.shaping_commands("eth0", None, 1e8, latency_ms=0.5, netem=False)
    assert "netem" not in " ".join(" ".join(c) for c in without)


def test_link_shapes_both_ends():
    cmds = net.link_commands("t1", 0, "a", 1e8, 0.5, 0.0, False)
    devs = {c[c.index("dev") + 1] for c in cmds}
    assert devs == {"eth0", "aev-t1-0"}


@pytest.mark.parametrize("bps", [1e4, 2e7, 1e8, 1e9, 1e10])
def test_queue_holds_about_100ms_within_bounds(bps):
    n = net.queue_packets(bps)
    assert 64 <= n <= 1000
    if 64 < n < 1000:
        assert n * 1514 * 8 / bps == pytest.approx(0.1, rel=0.01)


def test_drop_bytecode_encodes_loss_and_reads_back():
    assert net.drop_bytecode(0) == "1,6 0 0 0"
    assert net.drop_bytecode(100) == "1,6 0 0 4294967295"
    code = net.drop_bytecode(25)
    assert code == "4,32 0 0 4294963256,53 1 0 1073741824,6 0 0 4294967295,6 0 0 0"
    for pct in (0, 0.1, 1, 25, 99.9, 100):
        assert net.loss_of_bytecode(net.drop_bytecode(pct)) == pytest.approx(pct)
    assert net.loss_of_bytecode("2,6 0 0 1,6 0 0 0") is None


def test_loss_replaces_the_filter_on_both_ends_idempotently():
    (cmd,) = net.loss_commands("eth0", "ae-t1-a", 100)
    assert cmd[3:6] == ["filter", "replace", "dev"]
    assert cmd[cmd.index("bytecode") + 1] == "1,6 0 0 4294967295"


def test_delete_removes_namespaces_then_veths_then_bridges():
    cmds = net.delete_commands(["ae-t1-a"], ["aebr-t1", "aev-t1-1", "aev-t1-0"])
    assert cmds == [
        ["ip", "netns", "del", "ae-t1-a"],
        ["ip", "link", "del", "aev-t1-0"],
        ["ip", "link", "del", "aev-t1-1"],
        ["ip", "link", "del", "aebr-t1"],
    ]


def test_run_reports_the_command_and_stderr():
    with pytest.raises(net.NetError, match="ls /no/such/dir"):
        net.run(["ls", "/no/such/dir"])
    assert net.run(["ls", "/no/such/dir"], check=False) == ""
    with pytest.raises(net.NetError, match="no-such-binary"):
        net.run(["no-such-binary-here"])


def test_with_iptables_the_bridge_accepts_its_own_forwarding_first():
    cmds = net.bridge_commands("abc123", "10.77.5.0/24", "10.77.5.1", iptables=True)
    assert cmds[0] == ["iptables", "-I", *net.forward_rule("abc123")]
    assert net.bridge_commands("abc123", "10.77.5.0/24", "10.77.5.1") == cmds[1:]
    rule = " ".join(net.forward_rule("abc123"))
    assert "-i aebr-abc123 -o aebr-abc123" in rule and rule.endswith("-j ACCEPT")


@pytest.mark.parametrize(
    ("line", "tag"),
    [
        (
            "-A FORWARD -i aebr-abc -o aebr-abc -m comment --comment asteroid-testbed-abc "
            "-j ACCEPT",
            "abc",
        ),
        ('-A FORWARD -m comment --comment "asteroid-testbed-t1" -j ACCEPT', "t1"),
        ("-A FORWARD -j DOCKER-USER", None),
        ("-A FORWARD -m comment --comment asteroid-testbed-abcx-other -j ACCEPT", None),
        ("-A FORWARD -m comment --comment not-asteroid-testbed-abc -j ACCEPT", None),
    ],
)
def test_forward_rules_are_ours_only_by_their_exact_comment(line, tag):
    assert net.forward_tag(line) == tag
