"""Weight versions of the asynchronous mode (FTPipeHD, PipeDream): which micro-batch uses which.

In `mode: async` every micro-batch of a window is a mini-batch of its own:
each stage applies its update right after that micro-batch's backward, and
the pipeline is not flushed between them, so a forward runs on weights a few
updates old. Vertical sync makes the version the same on every stage: the one
the first stage held when, in its canonical 1F1B order, it forwarded the
micro-batch (after the backward of micro-batch j - K_0). Every stage computes
it from the micro-batch index alone, so nothing travels with the activations,
and the run is deterministic: a single process can replay it (delayed
gradients) and must get the same weights.

Versions count from the start of a window (when every update of the previous
windows is applied, the pipeline having drained): version n exists after n
weight changes, a change being an update or, every `aggregate_every` updates,
FTPipeHD's aggregation (the mean of the last K_0 updated versions, which the
stage trained concurrently from stale bases).
"""

from __future__ import annotations

__all__ = ["aggregates_after", "changes_after", "changes_per_window", "version_for"]


def aggregates_after(i: int, aggregate_every: int) -> bool:
    """True when the update of micro-batch `i` (0-based in its window) is followed by one."""
    return aggregate_every > 0 and (i + 1) % aggregate_every == 0


def changes_after(i: int, aggregate_every: int) -> int:
    """The window's weight version once micro-batch `i`'s update (and aggregation) is applied."""
    updates = i + 1
    return updates + (updates // aggregate_every if aggregate_every > 0 else 0)


def version_for(j: int, k0: int, aggregate_every: int) -> int:
    """The version micro-batch `j` runs on, forward and backward, on every stage.

    The first stage forwards micro-batch j right after the backward of
    j - K_0 (1F1B after K_0 warm-up forwards); before that, on the window's
    starting weights.
    """
    return changes_after(j - k0, aggregate_every) if j >= k0 else 0


def changes_per_window(microbatches: int, aggregate_every: int) -> int:
    """Weight versions a whole window adds: the checkpoint of round r holds r times this."""
    return changes_after(microbatches - 1, aggregate_every)
