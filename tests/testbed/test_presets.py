"""Device kinds, environments and the clusters built from them."""

import pytest

from common.errors import ConfigError
from common.profile import ClusterSpec
from services.testbed.presets import (
    DEVICE_KINDS,
    ENVIRONMENTS,
    GALAXY_ENVIRONMENTS,
    GALAXY_HOMOGENEOUS_BUDGET,
    GALAXY_LINK_BPS,
    JETSON_NANO,
    JETSON_TX2,
    JETSON_XAVIER_NX,
    LINK_SPEEDS_BPS,
    NANO_L,
    NANO_M,
    NANO_S,
    cluster_for,
    device_kind,
    environment,
    galaxy_devices,
    slowdown,
)

GiB = 1 << 30


def test_table_1_memory_and_peak_throughput():
    assert (JETSON_NANO.memory_bytes, JETSON_NANO.tflops) == (4 * GiB, 0.472)
    assert (JETSON_TX2.memory_bytes, JETSON_TX2.tflops) == (8 * GiB, 1.33)
    assert (JETSON_XAVIER_NX.memory_bytes, JETSON_XAVIER_NX.tflops) == (8 * GiB, 1.69)
    assert all(k.source for k in DEVICE_KINDS.values())


def test_slowdown_is_the_ratio_of_peak_throughputs():
    assert slowdown(JETSON_XAVIER_NX, JETSON_XAVIER_NX) == 1.0
    assert slowdown(JETSON_TX2, JETSON_XAVIER_NX) == pytest.approx(1.69 / 1.33)
    assert slowdown(JETSON_NANO, JETSON_XAVIER_NX) == pytest.approx(1.69 / 0.472)
    assert slowdown(JETSON_NANO, JETSON_TX2) == pytest.approx(1.33 / 0.472)
    # faster than the reference: less than one
    assert slowdown(JETSON_XAVIER_NX, JETSON_NANO) == pytest.approx(0.472 / 1.69)


def test_galaxy_cpu_modes_are_the_clock_ratios_of_table_ii():
    modes = [device_kind(n) for n in ("Nano-L", "Nano-M", "Nano-S")]
    assert modes == [NANO_L, NANO_M, NANO_S]
    ratios = [1 / slowdown(k, NANO_L) for k in modes]
    assert ratios == pytest.approx([1.0, 0.825 / 1.47, 0.403 / 1.47])
    assert ratios == pytest.approx([1.0, 0.56, 0.27], abs=0.005)
    # four A53 cores x 8 fp32 FLOP per cycle at 1.47 GHz
    assert NANO_L.tflops == pytest.approx(4 * 1.47e9 * 8 / 1e12)
    assert [k.memory_bytes for k in modes] == [int(1.5 * GiB), int(1.2 * GiB), int(0.7 * GiB)]
    assert all("Table II" in k.source for k in modes)


@pytest.mark.parametrize(
    ("env", "kinds"),
    [
        ("Galaxy-A", ["Nano-M"] * 2),
        ("Galaxy-B", ["Nano-M"] * 3),
        ("Galaxy-C", ["Nano-M"] * 4),
        ("Galaxy-D", ["Nano-L", "Nano-M"]),
        ("Galaxy-E", ["Nano-L", "Nano-S"]),
        ("Galaxy-F", ["Nano-L", "Nano-M", "Nano-S"]),
    ],
)
def test_galaxy_environments_are_table_iii(env, kinds):
    assert [k.name for k, n in environment(env) for _ in range(n)] == kinds
    assert [d.kind.name for d in galaxy_devices(env)] == kinds


def test_galaxy_devices_slowdowns_and_budgets():
    f = galaxy_devices("Galaxy-F")
    assert [d.name for d in f] == ["nano-l-0", "nano-m-0", "nano-s-0"]
    assert [d.slowdown for d in f] == pytest.approx([1.0, 1.47 / 0.825, 1.47 / 0.403])
    assert [d.budget_bytes for d in f] == [int(1.5 * GiB), int(1.2 * GiB), int(0.7 * GiB)]
    # the homogeneous environments give Nano-M 1.5 GB (§IV-A)
    a = galaxy_devices("Galaxy-C")
    assert [d.name for d in a] == ["nano-m-0", "nano-m-1", "nano-m-2", "nano-m-3"]
    assert {d.budget_bytes for d in a} == {GALAXY_HOMOGENEOUS_BUDGET} == {int(1.5 * GiB)}
    assert [d.slowdown for d in a] == pytest.approx([1.47 / 0.825] * 4)
    half = galaxy_devices("Galaxy-E", memory_scale=0.5)
    assert [d.budget_bytes for d in half] == [int(1.5 * GiB) // 2, int(0.7 * GiB * 0.5)]
    assert GALAXY_LINK_BPS == 125e6


@pytest.mark.parametrize(("env", "scale"), [("A", 1.0), ("Galaxy-Z", 1.0), ("Galaxy-A", 0.0)])
def test_galaxy_devices_rejects_bad_input(env, scale):
    with pytest.raises(ConfigError, match=r"unknown Galaxy environment|memory_scale"):
        galaxy_devices(env, memory_scale=scale)


@pytest.mark.parametrize(
    ("env", "counts"),
    [
        ("A", {"Jetson Nano": 5}),
        ("B", {"Xavier NX": 3, "Jetson TX2": 2}),
        ("C", {"Xavier NX": 1, "Jetson TX2": 2, "Jetson Nano": 3}),
        ("D", {"Jetson TX2": 1, "Jetson Nano": 3}),
    ],
)
def test_asteroid_environments(env, counts):
    assert {k.name: n for k, n in environment(env)} == counts
    assert len(cluster_for(env, 1e9, "p").devices) == sum(counts.values())


def test_every_environment_names_known_kinds():
    for env in [*ENVIRONMENTS, *GALAXY_ENVIRONMENTS]:
        assert all(n >= 1 for _, n in environment(env))


def test_cluster_for_env_c_at_100_mbps():
    cluster = cluster_for("C", 100e6, "mobilenet_v2@nx", memory_scale=0.5)
    assert isinstance(cluster, ClusterSpec)
    assert [d.name for d in cluster.devices] == [
        "nx-0",
        "tx2-0",
        "tx2-1",
        "nano-0",
        "nano-1",
        "nano-2",
    ]
    assert cluster.bandwidth == pytest.approx(12.5e6)  # bytes/s
    assert cluster.bw("nx-0", "nano-2") == pytest.approx(12.5e6)
    by_name = {d.name: d for d in cluster.devices}
    assert by_name["nx-0"].memory_bytes == 4 * GiB
    assert by_name["tx2-1"].memory_bytes == 4 * GiB
    assert by_name["nano-0"].memory_bytes == 2 * GiB
    assert by_name["nx-0"].slowdown == 1.0
    assert by_name["tx2-0"].slowdown == pytest.approx(1.69 / 1.33)
    assert by_name["nano-2"].slowdown == pytest.approx(1.69 / 0.472)
    assert {d.profile for d in cluster.devices} == {"mobilenet_v2@nx"}
    # round-trips as the planner service receives it
    assert ClusterSpec.model_validate_json(cluster.model_dump_json()) == cluster


def test_cluster_for_other_reference_and_link_speeds():
    cluster = cluster_for("A", LINK_SPEEDS_BPS[1], "p", reference="Jetson Nano")
    assert cluster.bandwidth == pytest.approx(125e6)
    assert {d.slowdown for d in cluster.devices} == {1.0}
    assert {d.memory_bytes for d in cluster.devices} == {4 * GiB}
    assert LINK_SPEEDS_BPS == (100e6, 1e9)


def test_cluster_for_galaxy_names_cpu_modes_apart():
    cluster = cluster_for("Galaxy-F", GALAXY_LINK_BPS, "p", reference="Nano-L")
    assert [d.name for d in cluster.devices] == ["nano-l-0", "nano-m-0", "nano-s-0"]
    assert cluster.bandwidth == pytest.approx(125e6 / 8)
    homogeneous = cluster_for("Galaxy-B", GALAXY_LINK_BPS, "p", reference="Nano-L")
    assert {d.memory_bytes for d in homogeneous.devices} == {int(1.5 * GiB)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"env": "Z", "bandwidth_bps": 1e9}, "unknown environment 'Z'"),
        ({"env": "A", "bandwidth_bps": 0.0}, "bandwidth"),
        ({"env": "A", "bandwidth_bps": 1e9, "memory_scale": 0.0}, "memory_scale"),
        ({"env": "A", "bandwidth_bps": 1e9, "reference": "TPU"}, "unknown device kind 'TPU'"),
    ],
)
def test_cluster_for_rejects_bad_input(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cluster_for(profile_key="p", **kwargs)
