"""Weight versions of the asynchronous mode (FTPipeHD, PipeDream): which micro-batch uses which.

In `mode: async` every micro-batch is a mini-batch of its own: each stage
applies its update right after that micro-batch's backward, and the pipeline
is never flushed, neither inside a window (a round) nor between windows: the
first micro-batches of window r+1 are forwarded while window r finishes
(`services.worker.async_stream`). A forward therefore runs on weights a few
updates old. Vertical sync makes the version the same on every stage: the one
the first stage held when, in its canonical 1F1B order over the stream, it
forwarded the micro-batch (after the backward of micro-batch g - K_0). Every
stage computes it from the micro-batch's stream index alone, so nothing
travels with the activations, and the run is deterministic: a single process
can replay it (delayed gradients) and must get the same weights.

Indices and versions count from the last drain point, where a stage's
stream starts fresh on weights every earlier update made: the first round of
an Assign (job start, resume, recovery, re-partition). Micro-batch i of round
r has stream index g = (r - drain) * M + i. Version n exists after n weight
changes since the drain point, a change being an update or FTPipeHD's
aggregation (the mean of the last K_0 updated versions, which the stage
trained concurrently from stale bases). Aggregation follows every
`aggregate_every`-th update of a window (micro-batch i with (i + 1) a
multiple of it), so every window adds the same `changes_per_window` versions
wherever its stream started, and a checkpoint's version count needs no
history of drain points; when `aggregate_every` divides M this is every
`aggregate_every`-th update of the stream.
"""

from __future__ import annotations

__all__ = ["aggregates_after", "changes_after", "changes_per_window", "version_for"]


def aggregates_after(g: int, aggregate_every: int, microbatches: int) -> bool:
    """True when the update of stream index `g` is followed by an aggregation."""
    return aggregate_every > 0 and (g % microbatches + 1) % aggregate_every == 0


def changes_after(g: int, aggregate_every: int, microbatches: int) -> int:
    """The stream's weight version once index `g`'s update (and aggregation) is applied."""
    updates = g + 1
    if aggregate_every <= 0:
        return updates
    windows, rest = divmod(updates, microbatches)
    return updates + windows * (microbatches // aggregate_every) + rest // aggregate_every


def version_for(g: int, k0: int, aggregate_every: int, microbatches: int) -> int:
    """The version stream index `g` runs on, forward and backward, on every stage.

    The first stage forwards stream index g right after the backward of
    g - K_0 (1F1B after K_0 warm-up forwards); before that, on the weights
    at the drain point.
    """
    return changes_after(g - k0, aggregate_every, microbatches) if g >= k0 else 0


def changes_per_window(microbatches: int, aggregate_every: int) -> int:
    """Weight versions a whole window adds: the checkpoint of round r holds r times this."""
    return changes_after(microbatches - 1, aggregate_every, microbatches)
