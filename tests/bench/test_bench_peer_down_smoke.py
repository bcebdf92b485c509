"""The neighbour-report bench: its table from made-up times, and two real trials."""

from __future__ import annotations

from tests.bench.bench_peer_down import main, report


def test_the_report_gives_median_p90_and_max_in_milliseconds() -> None:
    text = report([0.010, 0.020, 0.030], [0.1, 0.2], missed=1, trials=4)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    assert [c.strip() for c in rows["SIGKILL -> disconnected"].split("|")[2:5]] == [
        "20.0",
        "30.0",
        "30.0",
    ]
    assert "(1 missed)" in text
    assert report([], [], missed=2, trials=2).count("| - | - | - |") == 2


def test_two_trials_on_real_processes_are_each_reported() -> None:
    assert main(["--trials", "2"]) == 0
