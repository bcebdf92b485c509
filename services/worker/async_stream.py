"""The asynchronous mode's stream: micro-batches keep entering across window boundaries.

In `mode: async` a round is a window of M micro-batches, but the pipeline is
not drained between windows (PipeDream, FTPipeHD): while stage s finishes
window r under 1F1B it already forwards the first micro-batches of window
r+1, as many as its in-flight bound leaves room for (at most K_s - 1, where
K_s is the 1F1B warm-up capped at the first stage's). Its round ends, and it
reports RoundDone, after its own backward and update of micro-batch M-1 of
window r. The forwards run ahead change no weight (they run on stashed
versions, with copies of the buffers), so the live state at RoundDone r holds
every update of windows <= r and none later on every stage: checkpoints,
replicas and the coordinator's commit see a consistent cut. They are carried
into round r+1 when its RunRound comes; anything else (a new Assign, a jump)
drops them, and nothing committed depended on them.

Inside round r a stage numbers its micro-batches 0..M+L-1: slots below M are
window r's, slot M+i is window r+1's micro-batch i (L forwards run ahead).
Versions are counted over the stream from its drain point, the round where the
stage's stream started fresh (the Assign's from_round: job start, resume,
recovery, re-partition): micro-batch i of round r has stream index
g = (r - drain) * M + i, and runs on `common.async_versions.version_for(g)`.

An update's cost: a stage updates after every micro-batch, so what an update
does besides the optimizer's step is paid M times a window and decides whether
async beats sync's bubble. It takes the gradients off the stashed version, steps
(the learning rate is set once per window), and copies the new version into a
stash slot a dropped version gave back (`WeightStash`); it checks nothing. The
live weights are checked once per window, before RoundDone, which still keeps
inf and nan from every replica, checkpoint and committed round (they all read
the live weights at a round's end or later): a non-finite gradient makes the
weights it updates non-finite (w - lr * nan is nan, w - lr * inf is inf, Adam's
moments turn nan), later updates keep them so (nan and inf absorb any finite
step, inf - inf is nan), an aggregation's mean with a non-finite version is
non-finite, and every later version derives from the live weights. What leaves
a stage before the window's end (activations, gradients, the loss) is still
checked per micro-batch where it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.async_versions import version_for

__all__ = ["Ahead", "AsyncStream"]


@dataclass
class Ahead:
    """Forwards of window `round_no` run during the previous round, keyed by its micro-batch."""

    round_no: int
    ctx: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Input and output of each forward run ahead, for its backward."""
    kept: dict[int, int] = field(default_factory=dict)
    """Bytes each of them keeps (saved tensors, input and output)."""
    used: dict[int, int] = field(default_factory=dict)
    """The version each ran on."""
    buffers: dict[str, torch.Tensor] | None = None
    """The module's buffers as those forwards left them (batch-norm statistics): the live
    buffers stay at the cut until the window starts."""


class AsyncStream:
    """One stage's stream of micro-batches from its drain point, and what runs ahead.

    Args:
        drain_round: The round the stream starts at (the Assign's from_round).
        microbatches: M, micro-batches per window.
        k: This stage's 1F1B warm-up K_s.
        k0: The first stage's warm-up, which fixes every version (vertical sync).
        aggregate_every: FTPipeHD's aggregation period (0: never).
        total_rounds: Rounds of the job: the last window has no next one to run ahead into.

    """

    def __init__(
        self,
        drain_round: int,
        microbatches: int,
        k: int,
        k0: int,
        aggregate_every: int,
        total_rounds: int,
    ) -> None:
        self.m, self.k0, self.every = microbatches, k0, aggregate_every
        self.limit = max(1, min(k, k0))
        """Micro-batches in flight at most: K_s, never above K_0 (a version must exist before
        its forward runs: the first stage's backward of g - K_0 made it)."""
        self.total_rounds = total_rounds
        self.drain = drain_round
        self.next_round = drain_round
        self.version = 0
        """The version the live weights hold, counted from the drain point."""
        self.updated: list[int] = []
        """The last K_0 versions updates made, oldest first (FTPipeHD's aggregation)."""
        self.ahead: Ahead | None = None

    def lookahead(self, round_no: int) -> int:
        """How many forwards of window `round_no` + 1 may run during round `round_no`."""
        return self.limit - 1 if round_no + 1 < self.total_rounds else 0

    def slots(self, round_no: int) -> int:
        """Forward slots of round `round_no`: its window and the forwards run ahead."""
        return self.m + self.lookahead(round_no)

    def locate(self, round_no: int, slot: int) -> tuple[int, int]:
        """The window and micro-batch of forward slot `slot` of round `round_no`."""
        return (round_no + 1, slot - self.m) if slot >= self.m else (round_no, slot)

    def version_of(self, round_no: int, slot: int) -> int:
        """The version slot `slot` of round `round_no` runs on (vertical sync over the stream)."""
        window, mb = self.locate(round_no, slot)
        return version_for((window - self.drain) * self.m + mb, self.k0, self.every, self.m)

    def restart(self, round_no: int) -> None:
        """A drain point: the stream starts afresh at `round_no` on the live weights."""
        self.drain = self.next_round = round_no
        self.version = 0
        self.updated = []
        self.ahead = None

    def begin(self, round_no: int) -> tuple[bool, Ahead | None]:
        """Start round `round_no`: whether the stream restarts here, and what ran ahead for it.

        Only the round after the last one continues the stream; any other
        (the stage's first, or a jump) is a drain point, and forwards run
        ahead for another round are dropped.
        """
        ahead, self.ahead = self.ahead, None
        if round_no != self.next_round or round_no == self.drain:
            self.restart(round_no)
            return True, None
        return False, ahead if ahead is not None and ahead.round_no == round_no else None

    def end(
        self,
        round_no: int,
        ctx: dict[int, tuple[torch.Tensor, torch.Tensor]],
        kept: dict[int, int],
        used: dict[int, int],
        buffers: dict[str, torch.Tensor] | None,
    ) -> None:
        """Round `round_no` is done: keep its forwards of the next window, re-indexed from 0."""
        self.next_round = round_no + 1
        ahead = Ahead(round_no + 1, buffers=buffers)
        for slot in sorted(s for s in ctx if s >= self.m):
            ahead.ctx[slot - self.m] = ctx.pop(slot)
            ahead.kept[slot - self.m] = kept.pop(slot)
            ahead.used[slot - self.m] = used.pop(slot)
        if ctx:
            raise RuntimeError(f"round {round_no} ended with backwards {sorted(ctx)} not run")
        self.ahead = ahead if ahead.ctx else None

    def needed(self, next_slot: int, round_no: int) -> set[int]:
        """Versions still to be used by forwards not yet run (that exist already) and the recent.

        A forward of stream index g runs on the version the update of g - K_0
        made, so the forwards to come that can need an existing version are
        the next K_0 ones; with aggregation the last K_0 updated versions too.
        """
        window, mb = self.locate(round_no, next_slot)
        g = (window - self.drain) * self.m + mb
        to_come = {version_for(j, self.k0, self.every, self.m) for j in range(g, g + self.k0)}
        recent = set(self.updated) if self.every else set()
        return {self.version, *to_come, *recent}
