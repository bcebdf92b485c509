"""The sample ledger: which samples each committed round trained, across recoveries.

The coordinator appends one entry per committed round (`round`, the plan
`epoch` it ran under, the training `positions` [lo, hi) and the `samples` those
positions are) to the job's `ledger` stream, and a rollback marker
(`rollback_to`) when a recovery resumes every stage from an older version. The
effective history is what survives the rollbacks: N committed rounds are N
steps of single-device training, so every sample of an epoch appears in it
exactly once, failures or not. Kept pure so tests and tools read it alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["effective_rounds", "rollback_entry", "round_entry"]


def round_entry(round_no: int, epoch: int, lo: int, hi: int, samples: list[int]) -> dict[str, Any]:
    """The ledger entry of committed round `round_no`."""
    return {"round": round_no, "epoch": epoch, "positions": [lo, hi], "samples": samples}


def rollback_entry(to_round: int, lost: list[str]) -> dict[str, Any]:
    """The marker of a recovery that resumes every stage from the weights of `to_round`."""
    return {"rollback_to": to_round, "lost": lost}


def effective_rounds(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The committed rounds that stand, in order: a rollback to v undoes rounds v and later.

    Rollbacks with no round committed between them are one recovery that started
    again (a second loss while the first was recovered): only the last says which
    version every stage resumed from, so rounds an earlier one undid stand again
    when the last resumes from a newer version (a checkpoint newer than the replica
    the first one chose).

    Raises ValueError if a round is committed twice without a rollback between,
    or out of order: either would mean a round was applied twice.
    """
    kept: list[dict[str, Any]] = []
    undone: list[dict[str, Any]] = []
    """Rounds undone by the rollbacks since the last commit: a later rollback may keep them."""
    for entry in entries:
        if "rollback_to" in entry:
            to = int(entry["rollback_to"])
            history = kept + undone
            kept = [e for e in history if int(e["round"]) < to]
            undone = [e for e in history if int(e["round"]) >= to]
            continue
        undone = []
        want = int(kept[-1]["round"]) + 1 if kept else None
        got = int(entry["round"])
        if want is not None and got != want:
            raise ValueError(f"ledger: round {got} committed after round {want - 1}")
        kept.append(entry)
    return kept
