import pytest

from common.errors import ConfigError
from common.ids import DeviceId
from common.messages import Heartbeat
from common.profile import ClusterSpec, DeviceSpec
from services.coordinator.membership import Member
from services.coordinator.profiling import batch_sizes, cluster_for, host_crowding


@pytest.mark.parametrize(
    ("micro", "sizes"),
    [(1, [1]), (2, [1, 2]), (16, [1, 2, 4, 8, 16]), (12, [1, 2, 4, 8, 12]), (3, [1, 2, 3])],
)
def test_batch_sizes_cover_every_share_of_a_micro_batch(micro, sizes):
    assert batch_sizes(micro) == sizes


def _members(**budgets):
    return {
        DeviceId(d): Member(
            DeviceId(d),
            0.0,
            Heartbeat(device=DeviceId(d), data_addr="tcp://x:1", memory_budget=b, fingerprint="fp"),
        )
        for d, b in budgets.items()
    }


def test_cluster_from_workers_uses_reported_then_profiled_memory():
    members = _members(a=2 << 30, b=0)
    keys = {DeviceId("a"): "m:fp", DeviceId("b"): "m:fp"}
    cluster = cluster_for(members, keys, {"m:fp": 5 << 30}, None, 1e6)
    assert [(d.name, d.memory_bytes, d.profile) for d in cluster.devices] == [
        ("a", 2 << 30, "m:fp"),
        ("b", 5 << 30, "m:fp"),
    ]
    assert cluster.bandwidth == 1e6 and cluster.links == {}


def test_a_cluster_file_gives_links_slowdowns_and_missing_budgets():
    base = ClusterSpec(
        devices=[DeviceSpec(name="b", memory_bytes=1 << 30, slowdown=2.0)],
        bandwidth=3e6,
        links={"a|b": 1e6},
    )
    members = _members(a=2 << 30, b=0)
    keys = {DeviceId("a"): "k", DeviceId("b"): "k"}
    cluster = cluster_for(members, keys, {"k": 9 << 30}, base, 1e9)
    b = cluster.device("b")
    assert (b.memory_bytes, b.slowdown) == (1 << 30, 2.0)
    assert cluster.bw("a", "b") == 1e6 and cluster.bandwidth == 3e6


def test_measured_slowdowns_multiply_what_the_cluster_file_says():
    base = ClusterSpec(devices=[DeviceSpec(name="b", memory_bytes=1 << 30, slowdown=2.0)])
    members = _members(a=2 << 30, b=0)
    keys = {DeviceId("a"): "k", DeviceId("b"): "k"}
    measured = {DeviceId("b"): 3.0}
    cluster = cluster_for(members, keys, {"k": 9 << 30}, base, 1e9, None, measured)
    assert (cluster.device("a").slowdown, cluster.device("b").slowdown) == (1.0, 6.0)


def test_a_worker_without_any_memory_figure_is_named():
    with pytest.raises(ConfigError, match="worker b reported no memory budget"):
        cluster_for(_members(a=1, b=0), {DeviceId("a"): "k", DeviceId("b"): "k"}, {"k": 0}, None, 1)


def _crowd(*workers):
    return {
        DeviceId(d): Member(
            DeviceId(d),
            0.0,
            Heartbeat(device=DeviceId(d), data_addr="x", threads=t, host=h, cores=c),
        )
        for d, h, t, c in workers
    }


def test_workers_sharing_a_machine_are_slowed_by_its_oversubscription():
    crowd = host_crowding(
        _crowd(("a", "pc", 1, 2), ("b", "pc", 1, 2), ("c", "pc", 2, 2), ("d", "pi", 1, 4))
    )
    assert crowd == {"a": 2.0, "b": 2.0, "c": 2.0, "d": 1.0}


def test_unknown_host_or_cores_means_no_crowding():
    assert host_crowding(_crowd(("a", "", 4, 2), ("b", "pc", 1, 0))) == {"a": 2.0, "b": 1.0}


def test_quotas_cap_what_each_worker_can_keep_busy():
    members = _crowd(("a", "pc", 1, 2), ("b", "pc", 1, 2), ("c", "pc", 1, 2))
    quota = {
        d: Member(d, 0.0, m.info.model_copy(update={"cpu_quota": 0.5})) for d, m in members.items()
    }
    assert set(host_crowding(quota).values()) == {1.0}  # 1.5 of 2 cores: no crowding
    assert set(host_crowding(members).values()) == {1.5}
