"""Inside the testbed the profiler sees what the testbed set.

A device with half the CPU quota profiles about twice as slow, the profile's
fingerprint names the quota and limit, and our bandwidth probe (ZeroMQ, the
profiler's `probe_link` to a `BandwidthSink`) measures the shaped link rate.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest

from services.testbed.bed import Testbed
from services.testbed.spec import TestbedSpec

pytestmark = pytest.mark.integration
MiB = 1 << 20

PROFILE = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(1)
    from common.zoo import ModelSpec
    from common.device import cgroup_memory_limit, cpu_quota
    from services.profiler.layers import profile_model
    p = profile_model(ModelSpec(name="small_cnn"), [16], repeats=7, warmup=2)
    total = sum(l.forward_s[0] + l.backward_s[0] for l in p.layers)
    print(json.dumps({"total": total, "quota": cpu_quota(), "limit": cgroup_memory_limit(),
                      "device": p.device}))
    """
)

SINK = textwrap.dedent(
    """
    import sys, time, zmq
    from services.worker.bandwidth import BandwidthSink
    with BandwidthSink(zmq.Context(), f"tcp://{sys.argv[1]}:7100") as sink:
        print("listening", sink.endpoint, flush=True)
        time.sleep(120)
    """
)

PROBE = textwrap.dedent(
    """
    import sys, zmq
    from services.worker.bandwidth import probe_link
    ctx = zmq.Context()
    probe_link(ctx, sys.argv[1], nbytes=1 << 18, count=4, timeout_s=30)  # warm the path
    got = probe_link(ctx, sys.argv[1], nbytes=1 << 20, count=24, timeout_s=60)
    print(got.bytes_per_s * 8)
    """
)


def spec(subnet: str, bandwidth: float) -> TestbedSpec:
    devices = [
        {"name": "half", "cpu": 0.5, "memory_bytes": 768 * MiB, "bandwidth_bps": bandwidth},
        {"name": "quarter", "cpu": 0.25, "memory_bytes": 640 * MiB, "bandwidth_bps": bandwidth},
    ]
    return TestbedSpec.model_validate({"name": "prof", "subnet": subnet, "devices": devices})


def test_half_the_quota_profiles_twice_as_slow(tmp_path, subnet, tag, budget):
    with Testbed(spec(subnet, 1e9), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        seen = {}
        for dev in ("half", "quarter"):  # one after the other: no contention between them
            res = tb.run(dev, [sys.executable, "-c", PROFILE], timeout_s=budget.left(300))
            assert res.returncode == 0, res.stderr[-2000:]
            seen[dev] = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["half"]["quota"] == pytest.approx(0.5)
    assert seen["quarter"]["quota"] == pytest.approx(0.25)
    assert seen["half"]["limit"] == 768 * MiB and seen["quarter"]["limit"] == 640 * MiB
    assert "-q0.5-" in seen["half"]["device"] and "-q0.25-" in seen["quarter"]["device"]
    # about twice: CFS throttling in 10 ms periods costs the smaller quota a bit more
    # (2.54 seen once), and the machine's own load moves both measurements
    ratio = seen["quarter"]["total"] / seen["half"]["total"]
    assert 1.5 < ratio < 3.0, seen


@pytest.mark.parametrize("bandwidth", [20e6, 100e6])
def test_bandwidth_probe_measures_the_shaped_rate(tmp_path, subnet, tag, bandwidth):
    with Testbed(spec(subnet, bandwidth), tmp_path, tag=tag) as tb:
        tb.up(services=False)
        sink_host = tb.address("quarter")
        tb.start("quarter", "sink", [sys.executable, "-c", SINK, sink_host])
        log = tb.log_dir / "sink.log"
        deadline = time.monotonic() + 60
        while not (log.exists() and "listening" in log.read_text()):
            assert time.monotonic() < deadline, tb.tail("sink")
            tb.check()
            time.sleep(0.1)
        res = tb.run(
            "half", [sys.executable, "-c", PROBE, f"tcp://{sink_host}:7100"], timeout_s=120
        )
        assert res.returncode == 0, res.stderr[-2000:]
        bits_per_s = float(res.stdout.strip().splitlines()[-1])
    # payload goodput over TCP: 1448 of every 1514 bytes on the wire carry data
    assert bits_per_s == pytest.approx(bandwidth * 1448 / 1514, rel=0.10)
