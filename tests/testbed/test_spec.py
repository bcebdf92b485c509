"""Testbed specs: validation, presets' CPU and memory scaling, the planner's view."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from common.errors import ConfigError
from services.testbed.presets import DEVICE_KINDS, environment
from services.testbed.spec import (
    CPU_BUDGET,
    GALAXY_WORKER_BYTES,
    MAX_DEVICE_CPU,
    MEMORY_FLOOR,
    MEMORY_SCALE,
    PRESETS,
    WORKER_BASELINE_BYTES,
    TestbedSpec,
    cluster_spec,
    load_testbed,
    parse_bytes,
    parse_rate,
    preset,
)

MiB = 1 << 20
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "testbed"


def dev(name: str = "a", **kw: object) -> dict[str, object]:
    return {"name": name, "cpu": 0.3, "memory_bytes": 512 * MiB, "bandwidth_bps": 1e8, **kw}


def spec(*devices: dict[str, object], **kw: object) -> TestbedSpec:
    return TestbedSpec.model_validate({"name": "t", "devices": list(devices), **kw})


def test_rates_and_sizes_parse_like_tc_and_iec():
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("20Mbit") == 2e7
    assert parse_rate(5e6) == 5e6
    assert parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("1GB") == 10**9
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_text_units_are_accepted_in_a_spec():
    d = spec(dev(memory_bytes="1GiB", bandwidth_bps="20mbit")).devices[0]
    assert (d.memory_bytes, d.bandwidth_bps) == (1 << 30, 2e7)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (dev(extra=1), "extra"),
        (dev(name="Nano_0"), "name"),
        (dev(name="-a"), "name"),
        (dev(name="a" * 33), "name"),
        (dev(cpu=0), "cpu"),
        (dev(memory_bytes=1000), "memory_bytes"),
        (dev(bandwidth_bps="lots"), "bandwidth_bps"),
        (dev(loss_pct=101), "loss_pct"),
        (dev(latency_ms=-1), "latency_ms"),
    ],
)
def test_invalid_devices_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as err:
        spec(bad)
    assert field in str(err.value)


def test_names_must_be_unique():
    with pytest.raises(ValidationError, match="repeat"):
        spec(dev("a"), dev("a"))


@pytest.mark.parametrize("subnet", ["8.8.8.0/24", "10.77.0.1/24", "127.0.0.0/24", "nonsense"])
def test_subnet_must_be_a_private_network(subnet):
    with pytest.raises(ValidationError, match="subnet"):
        spec(dev(), subnet=subnet)


def test_device_count_is_bounded_by_the_cap_and_the_subnet():
    many = [dev(f"d{i}") for i in range(251)]
    with pytest.raises(ValidationError):
        spec(*many, subnet="10.0.0.0/16")
    with pytest.raises(ValidationError, match="room for 5"):
        spec(*[dev(f"d{i}") for i in range(6)], subnet="10.77.0.0/28")
    assert len(spec(*[dev(f"d{i}") for i in range(5)], subnet="10.77.0.0/28").devices) == 5


def test_addresses_follow_the_layout():
    s = spec(dev("a"), dev("b"), subnet="10.77.3.0/24")
    assert s.bridge_address() == "10.77.3.1"
    assert [s.address("a"), s.address("b")] == ["10.77.3.10", "10.77.3.11"]
    with pytest.raises(ConfigError, match="no device 'c'"):
        s.address("c")


def test_oversubscribed_cpu_and_tiny_memory_are_warnings_not_errors():
    s = spec(dev("a", cpu=1.5), dev("b", cpu=1.0, memory_bytes=128 * MiB))
    warnings = s.warnings(cores=2)
    assert any("2.50 cores" in w for w in warnings)
    assert any("['b']" in w for w in warnings)
    assert spec(dev()).warnings(cores=2) == []


def test_load_testbed_names_file_and_field(tmp_path):
    bad = tmp_path / "bed.yaml"
    bad.write_text("name: x\ndevices:\n  - {name: a, cpu: 0.3, memory_bytes: 1GiB}\n")
    with pytest.raises(ConfigError, match=r"bed.yaml: devices.0.bandwidth_bps: required"):
        load_testbed(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="mapping"):
        load_testbed(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_testbed(tmp_path / "missing.yaml")


def test_deploy_examples_load_and_the_written_out_preset_matches_the_code():
    for path in sorted(DEPLOY.glob("*.yaml")):
        load_testbed(path)
    assert load_testbed(DEPLOY / "env-c-100mbit.yaml") == preset("env-c", "100mbit")


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_scale_cpu_by_tflops_within_the_budget(name):
    s = preset(name)
    kinds = {d.kind for d in s.devices}
    counts = {k.name: n for k, n in environment(PRESETS[name])}
    assert {k: sum(d.kind == k for d in s.devices) for k in kinds} == counts
    assert sum(d.cpu for d in s.devices) <= CPU_BUDGET + 1e-9
    assert max(d.cpu for d in s.devices) <= MAX_DEVICE_CPU + 1e-9
    # the binding constraint is met within rounding: the machine is used, not wasted
    assert max(d.cpu for d in s.devices) > MAX_DEVICE_CPU - 0.01 or (
        sum(d.cpu for d in s.devices) > CPU_BUDGET - 0.01
    )
    ref = s.devices[0]
    for d in s.devices:
        want = DEVICE_KINDS[d.kind].tflops / DEVICE_KINDS[ref.kind].tflops
        assert d.cpu / ref.cpu == pytest.approx(want, rel=0.01)
    assert s.warnings(cores=2) == []


@pytest.mark.parametrize("name", [p for p in PRESETS if not p.startswith("galaxy-")])
def test_presets_scale_memory_with_a_floor(name):
    for d in preset(name).devices:
        kind = DEVICE_KINDS[d.kind]
        assert d.memory_bytes == max(MEMORY_FLOOR, int(kind.memory_bytes * MEMORY_SCALE))


def test_galaxy_presets_give_a_worker_room_plus_the_papers_budgets_scaled():
    """Galaxy §IV-A: budgets 1.5 / 1.2 / 0.7 GB (Nano-M 1.5 GB in A-C), here / 8."""
    for name in ("galaxy-a", "galaxy-f"):
        budgets = {
            d.name: (d.memory_bytes - GALAXY_WORKER_BYTES) / MiB for d in preset(name).devices
        }
        scaled = {k: round(v * 8 / 1024, 3) for k, v in budgets.items()}
        if name == "galaxy-a":
            assert scaled == {"nano-m-0": 1.5, "nano-m-1": 1.5}
        else:
            assert scaled == {"nano-l-0": 1.5, "nano-m-0": 1.2, "nano-s-0": 0.7}
    assert all(d.memory_bytes >= MEMORY_FLOOR for n in PRESETS for d in preset(n).devices)


def test_documented_preset_numbers():
    c = {d.kind: (d.cpu, d.memory_bytes // MiB) for d in preset("env-c").devices}
    assert c == {
        "Xavier NX": (0.468, 1024),
        "Jetson TX2": (0.369, 1024),
        "Jetson Nano": (0.13, 512),
    }
    assert {d.cpu for d in preset("env-a").devices} == {0.32}
    d = {d.kind: d.cpu for d in preset("env-d").devices}
    assert d == {"Jetson TX2": 0.5, "Jetson Nano": 0.177}


def test_preset_names_devices_like_common_presets_and_sets_the_link():
    s = preset("env-b", "100mbit")
    assert s.names() == ["nx-0", "nx-1", "nx-2", "tx2-0", "tx2-1"]
    assert {d.bandwidth_bps for d in s.devices} == {1e8}
    with pytest.raises(ConfigError, match="unknown testbed preset"):
        preset("env-z")
    with pytest.raises(ConfigError, match="link"):
        preset("env-a", "quick")


def test_cluster_spec_links_run_at_the_slower_end_in_bytes():
    s = spec(
        dev("fast", bandwidth_bps=1e9, latency_ms=0.5),
        dev("slow", bandwidth_bps=2e7, latency_ms=5),
        dev("mid", bandwidth_bps=1e8, latency_ms=0.5),
    )
    c = cluster_spec(s)
    assert c.bw("fast", "slow") == 2e7 / 8
    assert c.bw("slow", "fast") == 2e7 / 8
    assert c.bw("fast", "mid") == 1e8 / 8
    assert c.bandwidth == 2e7 / 8
    assert c.latency_s == pytest.approx(0.0055)
    assert [d.name for d in c.devices] == ["fast", "slow", "mid"]
    assert all(d.slowdown == 1.0 for d in c.devices)
    assert c.device("fast").memory_bytes == 512 * MiB - WORKER_BASELINE_BYTES


def test_cluster_spec_of_one_device_has_no_links():
    c = cluster_spec(spec(dev()))
    assert c.links == {} and c.latency_s == 0.0 and c.bandwidth == 1e8 / 8
