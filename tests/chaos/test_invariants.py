"""The chaos run's end checks catch what they are for: a sample twice or never, growth."""

from __future__ import annotations

from typing import Any

import torch

from common.ledger import rollback_entry, round_entry
from tests.chaos import invariants
from tests.chaos.invariants import GrowthRule
from tests.chaos.sampler import Sample, read_process

EPOCH = 8
BATCH = 4


def _ledger(rounds: int, order: list[int] | None = None) -> list[dict[str, Any]]:
    """A clean ledger: round r trains positions [rB, (r+1)B), sample = position mod EPOCH."""
    out = []
    for r in range(rounds):
        lo = r * BATCH
        out.append(round_entry(r, 1, lo, lo + BATCH, [p % EPOCH for p in range(lo, lo + BATCH)]))
    return out


def test_a_clean_ledger_with_a_rollback_passes() -> None:
    entries = _ledger(3)
    # rounds 2 and 3 ran, a recovery rolled back to 2 and ran them again
    replayed = _ledger(4)
    entries = [*entries, replayed[3], rollback_entry(2, ["b"]), replayed[2], replayed[3]]
    check = invariants.ledger(entries, 4, EPOCH)
    assert check.ok, check.detail
    assert "2 complete epochs of 8" in check.detail


def test_a_sample_trained_twice_in_an_epoch_is_caught() -> None:
    entries = _ledger(4)
    entries[1]["samples"] = [4, 5, 6, 4]  # 7 never, 4 twice
    check = invariants.ledger(entries, 4, EPOCH)
    assert not check.ok
    assert "epoch 0: twice [4], never [7]" in check.detail


def test_a_missing_round_a_round_applied_twice_and_a_gap_are_caught() -> None:
    entries = _ledger(4)
    assert "missing [3]" in invariants.ledger(entries[:3], 4, EPOCH).detail
    twice = [*entries[:2], entries[1], *entries[2:]]  # round 1 committed again, no rollback
    assert "round 1 committed after round 1" in invariants.ledger(twice, 4, EPOCH).detail
    entries[2] = round_entry(2, 1, 12, 16, [4, 5, 6, 7])
    assert "starts at position 12, not 8" in invariants.ledger(entries, 4, EPOCH).detail


def test_the_last_partial_epoch_may_be_short_but_never_repeats() -> None:
    entries = _ledger(3)  # 12 positions: one epoch of 8, half of the next
    assert invariants.ledger(entries, 3, EPOCH).ok
    entries[2]["samples"] = [0, 1, 1, 3]
    assert not invariants.ledger(entries, 3, EPOCH).ok


def test_weights_are_held_to_the_tolerance() -> None:
    ref = {"w": torch.zeros(3)}
    assert invariants.weights({"w": torch.full((3,), 5e-7)}, ref).ok
    far = invariants.weights({"w": torch.tensor([0.0, 2e-6, 0.0])}, ref)
    assert not far.ok and "2e-06" in far.detail
    assert not invariants.weights(None, ref).ok
    assert not invariants.weights({"v": torch.zeros(3)}, ref).ok


def _samples(name: str, rss: list[int], fds: list[int], period: float = 1.0) -> list[Sample]:
    return [
        Sample(i * period, name, 1, r, f, 10) for i, (r, f) in enumerate(zip(rss, fds, strict=True))
    ]


RULE = GrowthRule(warmup_s=5, window=3, min_life_s=10, fds_abs=8)


def test_a_flat_process_passes_and_a_leak_is_caught() -> None:
    flat = _samples("worker", [300_000] * 30, [40] * 30)
    assert invariants.growth(flat, 0.0, RULE).ok
    leaking_fds = _samples("worker", [300_000] * 30, [40 + i for i in range(30)])
    check = invariants.growth(leaking_fds, 0.0, RULE)
    assert not check.ok and "worker fds" in check.detail
    leaking_rss = _samples("coordinator", [200_000 + 20_000 * i for i in range(30)], [30] * 30)
    check = invariants.growth(leaking_rss, 0.0, RULE)
    assert not check.ok and "coordinator rss_kib" in check.detail


def test_noise_within_the_rule_passes_and_a_short_lived_process_is_not_judged() -> None:
    noisy = _samples("w", [300_000 + (i % 3) * 30_000 for i in range(30)], [40, 44] * 15)
    assert invariants.growth(noisy, 0.0, RULE).ok
    short = _samples("gone", [1, 2, 3, 400_000, 900_000], [1, 2, 3, 4, 900])
    check = invariants.growth([*short, *_samples("w", [1] * 30, [1] * 30)], 0.0, RULE)
    assert check.ok and "gone" not in check.detail
    assert not invariants.growth(short, 0.0, RULE).ok  # nothing judged is no evidence


def test_samples_after_the_job_ended_are_left_out() -> None:
    """A leaking process that then exits closes its files: the leak must still show."""
    leaking = _samples("worker", [300_000] * 30, [40 + i for i in range(25)] + [3] * 5)
    assert invariants.growth(leaking, 0.0, RULE).ok  # the exit hides it...
    check = invariants.growth(leaking, 0.0, RULE, until=24.0)
    assert not check.ok and "worker fds" in check.detail  # ...unless cut at the job's end


def test_this_process_can_be_sampled() -> None:
    import os

    got = read_process("me", os.getpid())
    assert got is not None and got.rss_kib > 0 and got.fds > 0 and got.threads >= 1
    assert read_process("none", 2**22 + 1) is None


def test_a_process_that_came_later_is_judged_from_when_it_went_to_work() -> None:
    # a spare worker idle for 20 s (3 files, little memory), then a stage from t=20 on:
    # its start is not growth, but a leak after it still is
    idle = [Sample(float(t), "j1.worker@7", 7, 100_000, 3, 1) for t in range(20)]
    busy = [Sample(float(t), "j1.worker@7", 7, 400_000, 50, 13) for t in range(20, 50)]
    assert not invariants.growth([*idle, *busy], 0.0, RULE).ok  # its first samples as baseline
    check = invariants.growth([*idle, *busy], 0.0, RULE, work_starts={"j1": [20.0]})
    assert check.ok, check.detail
    leaking = [Sample(float(t), "j1.worker@7", 7, 400_000, 30 + t, 13) for t in range(20, 50)]
    assert not invariants.growth([*idle, *leaking], 0.0, RULE, work_starts={"j1": [20.0]}).ok
    # a start outside the process's life (the coordinator it replaced) is not its own
    flat = _samples("coordinator@3", [300_000] * 30, [30] * 30)
    assert invariants.growth(flat, 0.0, RULE, work_starts={"coordinator": [100.0]}).ok
    assert invariants.growth(flat, 0.0, RULE, work_starts={"j10": [5.0]}).ok  # j1 is not j10
