"""The recovery bench's split of fault -> first commit into parts, and the detection signal."""

import pytest

from tests.bench.recovery_parts import Parts, detection_signal, split

HEARTBEATS = (
    "workers ['nano-0'] missed heartbeats for 3.2 s and did not answer a probe within 2 s "
    "while the coordinator waited for round 4"
)
LOST = "workers ['nano-0'] lost while the coordinator waited for round 4: "
"""How the coordinator's reasons begin when signals made the device a suspect."""


@pytest.mark.parametrize(
    ("reason", "signal"),
    [
        (HEARTBEATS, "heartbeats + probe"),
        (f"{LOST}nano-0: control connection closed 0.31 s ago; probe unanswered for 0.2 s",
         "connection closed"),
        (f"{LOST}nano-0: tx2-0 reported its connection to it closed 0.30 s ago; probe "
         "unanswered for 0.21 s", "connection closed"),
        (f"{LOST}nano-0: tx2-0 waited 1.50 s for its data; probe unanswered for 0.21 s",
         "peer silent"),
        (
            "worker nano-0 heartbeats but made no progress for 30 s in round 3 (watchdog)",
            "watchdog",
        ),
        ("worker nano-0 failed in round 3: out of memory", "worker error"),
        ("something new", "other"),
        ("", ""),
    ],
)  # fmt: skip
def test_the_signal_is_read_from_the_recovery_reason(reason: str, signal: str) -> None:
    assert detection_signal(reason) == signal


def test_a_refused_data_port_named_last_is_the_signal_of_its_own_loss_only() -> None:
    refused = (
        f"{LOST}nano-0: control connection closed 0.05 s ago; its data port refused a "
        "connection: no process listens"
    )
    assert detection_signal(refused) == "data port refused"
    later = f"{LOST}nano-1: control connection closed 0.1 s ago; its data port refused a connection"
    assert detection_signal(f"{HEARTBEATS}; {later}") == "heartbeats + probe"


def test_only_the_first_loss_names_the_signal() -> None:
    """A second loss during a recovery appends its reason after "; "."""
    reason = f"{LOST}nano-0: control connection closed 0.31 s ago; {HEARTBEATS}"
    assert detection_signal(reason) == "connection closed"
    later = f"{LOST}nano-1: control connection closed 0.1 s ago"
    assert detection_signal(f"{HEARTBEATS}; {later}") == "heartbeats + probe"


def test_the_parts_add_up_to_the_end_to_end_time() -> None:
    """The total is measured end to end; what re-plan and migrate leave is the gap."""
    parts = split(100.0, 100.4, 100.5, 0.02, 0.06, 101.3)
    assert parts.detect_s == pytest.approx(0.4)
    assert parts.gap_s == pytest.approx(0.02)
    assert parts.first_round_s == pytest.approx(0.8)
    assert parts.total_s == pytest.approx(1.3)
    named = [parts.detect_s, parts.replan_s, parts.migrate_s, parts.gap_s, parts.first_round_s]
    assert sum(p for p in named if p is not None) == pytest.approx(parts.total_s)


def test_a_missing_timestamp_leaves_its_parts_unknown_not_zero() -> None:
    no_commit = split(100.0, 100.4, 100.5, 0.02, 0.06, None)
    assert no_commit.first_round_s is None and no_commit.total_s is None
    assert no_commit.detect_s == pytest.approx(0.4)
    no_recovering = split(100.0, None, 100.5, 0.02, 0.06, 101.0)
    assert no_recovering.detect_s is None and no_recovering.gap_s is None
    assert no_recovering.total_s == pytest.approx(1.0)


def test_the_parts_read_as_one_line() -> None:
    line = Parts(0.41, 0.012, 0.05, None, 0.7, 1.2).named()
    assert line == "detect 0.41 + re-plan 0.01 + migrate 0.05 + gap x + first round 0.70 = 1.20 s"
