"""The heartbeat-jitter bench's report, from made-up arrival times (the run itself is a bench)."""

from __future__ import annotations

from tests.bench.bench_heartbeat_jitter import report


def test_the_report_gives_each_device_and_the_derived_timeouts() -> None:
    times = {
        "a": [i * 0.5 for i in range(40)],
        "b": [i * 0.5 + (0.07 if i == 20 else 0.0) for i in range(40)],
    }
    text = report(times, [2.0] + [0.4] * 20, heartbeat_s=0.5, burn=0)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    assert rows["a"].split("|")[2].strip() == "39"  # 40 heartbeats, 39 gaps
    assert "570" in rows["b"]  # the late heartbeat is the worst gap
    assert rows["rounds"].split("|")[2].strip() == "20"  # round 0 left out
    assert "heartbeat_deadline_s: 1.710 s, measured (3 x p99 gap 570 ms)" in text, text
    assert "peer_timeout_s: 1.200 s, measured (3 x p90 round 400 ms)" in text, text
