"""Where the time from a device's loss to the next committed round goes (pure).

A user waits from the failure to the first round committed after it. The
recovery bench splits that wait into the parts that make it, each from a
timestamp the services write anyway (Redis stream ids are the times their
entries were written, on the host's clock, as is the bench's fault time):

- detect: the fault -> the job's `recovering` event (the coordinator decided
  the device is lost);
- re-plan: the `recovered` event's `replan_s` (capacities read and the new
  plan made, or the planner's answer);
- migrate: its `migrate_s` (layers moved peer to peer, or gathered in Redis
  and reloaded, and every survivor assigned its new stage);
- gap: what `recovering` -> `recovered` holds beyond those two (stream
  writes, the coordinator's loop), so the parts add up;
- first round: `recovered` -> the first committed round's metrics entry (the
  replayed round, with the pipeline's links set up again).

The detection signal is read from the recovery's reason: which of the
coordinator's signals declared the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SIGNALS", "Parts", "detection_signal", "split"]

SIGNALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # most specific first: a reason may name several (a probe follows missed heartbeats)
    ("connection closed", ("disconnect", "connection closed", "closed")),
    ("peer silent", ("silent", "for its data", "receive timeout")),
    ("watchdog", ("watchdog",)),
    ("heartbeats + probe", ("probe",)),
    ("heartbeats", ("heartbeat",)),
    ("worker error", ("failed in round", "error")),
)
"""Detection signals and the words of the coordinator's reasons that name them."""
REFUSED = "refused a connection"
"""A closed control connection settled by the device's data port refusing a connect."""


def detection_signal(reason: str) -> str:
    """The signal that declared a loss, from the recovery's reason ("other" if none matches).

    Only the first reason counts: a second loss during a recovery appends its own.
    """
    clauses = [c.strip().lower() for c in reason.split(";")]
    # the first loss's clauses: up to where a second loss's reason begins
    own = [clauses[0]]
    for clause in clauses[1:]:
        if clause.startswith(("workers ", "worker ")):
            break
        own.append(clause)
    if any(REFUSED in c for c in own):
        # the coordinator names the refusal last, as what settled the loss
        return "data port refused"
    first = clauses[0]
    for name, words in SIGNALS:
        if any(w in first for w in words):
            return name
    return "other" if first.strip() else ""


@dataclass(frozen=True)
class Parts:
    """Seconds of each part of fault -> first commit; None where a timestamp is missing."""

    detect_s: float | None
    replan_s: float | None
    migrate_s: float | None
    gap_s: float | None
    first_round_s: float | None
    total_s: float | None

    def named(self) -> str:
        """ "detect 0.41 + re-plan 0.01 + ... = 1.23 s", for logs and tables."""
        parts = [
            ("detect", self.detect_s),
            ("re-plan", self.replan_s),
            ("migrate", self.migrate_s),
            ("gap", self.gap_s),
            ("first round", self.first_round_s),
        ]
        body = " + ".join(f"{n} {'x' if s is None else f'{s:.2f}'}" for n, s in parts)
        return f"{body} = {'x' if self.total_s is None else f'{self.total_s:.2f}'} s"


def split(
    t_fault: float | None,
    t_recovering: float | None,
    t_recovered: float | None,
    replan_s: float | None,
    migrate_s: float | None,
    t_first_commit: float | None,
) -> Parts:
    """Split fault -> first commit into its parts (see the module's docstring).

    The total is measured end to end (fault -> first commit), never summed, so
    a part that is missing or mismeasured cannot hide time: what the named
    parts leave is the gap. Clock granularity (stream ids are milliseconds) can
    make a part a millisecond negative; it is kept as measured.
    """
    detect = _diff(t_recovering, t_fault)
    between = _diff(t_recovered, t_recovering)
    gap = None
    if between is not None and replan_s is not None and migrate_s is not None:
        gap = between - replan_s - migrate_s
    return Parts(
        detect_s=detect,
        replan_s=replan_s,
        migrate_s=migrate_s,
        gap_s=gap,
        first_round_s=_diff(t_first_commit, t_recovered),
        total_s=_diff(t_first_commit, t_fault),
    )


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier
