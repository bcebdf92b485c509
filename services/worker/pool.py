"""The in-memory task pool of Asteroid's Fig. 11.

Receivers put activation, gradient and all-reduce parts here; a forward or
backward task becomes ready once parts cover the device's whole sample range
of that micro-batch. Parts of an older plan epoch or an already-finished round
are dropped, duplicates too, so replays never reach the scheduler.

Held-out evaluation parts (activations with phase "eval") live under their own
kind "E", keyed by the round whose weights they evaluate, so they can never
complete a training task. An evaluation of round R's weights is over once a
later evaluation begins or training round R starts (that changes the weights).

Parts are taken only from the device the plan names as their sender (the
`Expected` routes: who sends which sample range of activations and gradients,
and the all-reduce ring's previous device), only for the current round or the
next one, and only while the pool's bytes stay under its cap; everything else
is refused with a reason the receiver logs beside the sender. The sender is
whatever identity the transport reports for the peer.

A part from the very device the plan names that holds inf or nan, or labels
the loss cannot index (`services.worker.numerics`), is refused too, and then
the round cannot complete: that peer's fault is kept, and every wait fails at
once with a PeerDataError naming it, so that the job ends with that name
instead of training on poison or waiting out the task timeout.

With a neighbour timeout (the Assign's `peer_timeout_s`), a wait that has
lasted that long names the neighbours whose data it still lacks to
`on_silent`, once per round and neighbour, and goes on waiting: the
coordinator decides whether they are lost (`services.worker.peer_watch`).

The pool is also the worker's ledger of what it holds for a round: the bytes
of the tensors resident in it plus what the stage runner reports its forwards
keep for backwards that have not run (saved activations). Both change under
the pool's lock, so the per-round peak sees every arrival, even between tasks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from common.errors import PeerDataError, RoundAbortedError, RoundTimeoutError
from common.logging import get_logger
from common.messages import Activation, Gradient, ReduceChunk
from common.settings import POOL_MAX_BYTES
from services.worker.expected import Expected
from services.worker.numerics import describe_nonfinite, part_fault
from services.worker.peer_watch import SilenceWatch

__all__ = ["Expected", "Part", "SilentPeer", "TaskPool"]

T = TypeVar("T")
_log = get_logger(__name__)
SilentPeer = Callable[[int, str, float], None]
"""Told (epoch, neighbour, seconds waited) when a wait outlasts the neighbour timeout."""


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: what keeping them costs.

    A view costs its whole storage, and two views of one storage cost it once.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (e.g. sparse)
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@dataclass
class Part:
    """Samples [lo, hi) of one micro-batch: activation+labels or a gradient."""

    lo: int
    hi: int
    tensors: list[torch.Tensor]


def _describe(msg: Activation | Gradient, kind: str) -> str:
    """A part as a log line names it: "activations of micro-batch 2 ... in round 5"."""
    what = {"F": "activations", "B": "gradients", "E": "evaluation activations"}[kind]
    return f"{what} of micro-batch {msg.mb}, samples [{msg.lo}, {msg.hi}), in round {msg.round}"


def _kind(msg: Activation | Gradient) -> str:
    """The task kind a part belongs to: training forward, backward, or evaluation."""
    if isinstance(msg, Gradient):
        return "B"
    return "E" if msg.phase == "eval" else "F"


@dataclass
class _Slot:
    parts: dict[int, Part] = field(default_factory=dict)
    covered: int = 0
    nbytes: int = 0


class TaskPool:
    """Thread-safe store of incoming parts, keyed by (round, kind, micro-batch).

    For kind "E" the round names the evaluated weights and the micro-batch
    counts across the whole evaluation (batch x M + micro-batch).

    Args:
        max_bytes: Most bytes the pool holds; a part or chunk that would take it
            past this is refused (a flood cannot grow the worker without bound).

    """

    def __init__(self, max_bytes: int = POOL_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"pool max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.expected: Expected | None = None
        self.cond = threading.Condition()
        self.epoch = -1
        self.stage = -1
        self.round = -1
        self.eval_round = -1
        self.span = (0, 0)
        self._slots: dict[tuple[int, str, int], _Slot] = {}
        self._chunks: dict[tuple[int, int, int], torch.Tensor] = {}
        self.dropped = 0
        self.aborted: str | None = None
        self.fault: str | None = None
        """A plan member's poisoned part (what and who): every wait fails with it until reset."""
        self.saved_bytes = 0
        self.peak_bytes = 0
        self.peak_saved_bytes = 0
        self.silence = SilenceWatch()
        self.on_silent: SilentPeer | None = None
        """Called outside the lock, from the waiting thread, for each silent neighbour."""

    def abort(self, reason: str) -> None:
        """Make the current and next waits fail at once (until the next reset)."""
        with self.cond:
            self.aborted = reason
            self.cond.notify_all()

    @property
    def need(self) -> int:
        """Samples a task must cover: the device's share of a micro-batch."""
        return self.span[1] - self.span[0]

    def reset(
        self,
        epoch: int,
        stage: int,
        span: tuple[int, int],
        expected: Expected | None = None,
        from_round: int = 0,
        peer_timeout_s: float | None = None,
    ) -> None:
        """Serve `stage` of plan epoch `epoch`; a task is complete when parts cover `span`.

        `expected` names who sends what under the plan; with it, parts for rounds
        beyond the next are refused too (rounds run in order). A stage runner
        always gives it; only a harness without a plan (the transport benchmark,
        which numbers its streams freely) leaves senders and rounds unchecked.
        The first round to run is `from_round`, so its parts count as the next round's.
        A wait longer than `peer_timeout_s` reports the neighbours it waits for (None: never).
        """
        with self.cond:
            self.silence.reset(epoch, peer_timeout_s)
            self.epoch, self.stage, self.span = epoch, stage, span
            self.round = from_round - 1
            self.expected = expected
            self.eval_round = -1
            self.aborted = None
            self.fault = None
            self._slots.clear()
            self._chunks.clear()
            self.saved_bytes = 0
            self._new_peak()

    def begin_round(self, round_no: int) -> None:
        """Drop everything of rounds before `round_no`; later parts are kept.

        Evaluation parts of round `round_no`'s weights go too: training it
        changes them, so that evaluation is over. The peak restarts from what
        is held now; the saved activations of an earlier round went with it.
        """
        with self.cond:
            self.round = round_no
            self._slots = {k: v for k, v in self._slots.items() if not self._done(*k[:2])}
            self._chunks = {k: v for k, v in self._chunks.items() if k[0] >= round_no}
            self.saved_bytes = 0
            self._new_peak()

    def begin_eval(self, round_no: int) -> None:
        """Start evaluating round `round_no`'s weights; older evaluation parts are dropped.

        Parts of this evaluation that arrived early (the previous stage may
        start first) are kept.
        """
        with self.cond:
            self.eval_round = round_no
            self._slots = {k: v for k, v in self._slots.items() if not self._done(*k[:2])}

    def _done(self, round_no: int, kind: str) -> bool:
        """Whether tasks of (`round_no`, `kind`) can no longer be asked for (under `cond`)."""
        if kind == "E":
            return round_no < self.eval_round or round_no <= self.round
        return round_no < self.round

    def _fresh(self, msg: Activation | Gradient | ReduceChunk, kind: str) -> str | None:
        if msg.epoch != self.epoch:
            return f"plan epoch {msg.epoch}, current is {self.epoch}"
        if msg.stage != self.stage:
            return f"addressed to stage {msg.stage}, this worker runs stage {self.stage}"
        if self._done(msg.round, kind):
            if kind == "E":
                return (
                    f"evaluation of round {msg.round} is over (evaluating {self.eval_round}, "
                    f"training round {self.round})"
                )
            return f"round {msg.round} already finished (current {self.round})"
        if self.expected is not None and msg.round > self.round + 1:
            return f"round {msg.round} is beyond the next (current {self.round})"
        return None

    def _over_cap(self, nbytes: int) -> str | None:
        """Why `nbytes` more would not fit under the cap (under `cond`), or None."""
        held = self._resident()
        if held + nbytes > self.max_bytes:
            return (
                f"{nbytes} bytes would take the pool from {held} past its cap of "
                f"{self.max_bytes} (setting pool_max_bytes)"
            )
        return None

    def put_part(
        self, msg: Activation | Gradient, tensors: list[torch.Tensor], sender: str
    ) -> str | None:
        """Add a part `sender` sent; returns why it was dropped, or None when accepted."""
        kind, mb, round_no = _kind(msg), msg.mb, msg.round
        part = Part(msg.lo, msg.hi, tensors)
        nbytes = _storage_bytes(tensors)
        expected = self.expected  # replaced only by reset; checked outside the lock
        classes = expected.num_classes if expected is not None else None
        poison = part_fault(kind, tensors, msg.hi - msg.lo, classes)
        with self.cond:
            refused = self._fresh(msg, kind)
            if refused is None and self.expected is not None:
                refused = self.expected.refuse_part(kind, mb, msg.lo, msg.hi, sender)
            if refused:
                self.dropped += 1
                return refused
            key = (round_no, kind, mb)
            slot = self._slots.get(key, _Slot())
            if part.lo in slot.parts or not self.span[0] <= part.lo < part.hi <= self.span[1]:
                self.dropped += 1
                return f"duplicate or out-of-range part [{part.lo}, {part.hi}) of {kind}{mb}"
            if slot.covered + part.hi - part.lo > self.need:
                self.dropped += 1
                return f"overlapping part [{part.lo}, {part.hi}) of {kind}{mb}"
            if poison:
                return self._poisoned(f"{_describe(msg, kind)} from {sender!r}: {poison}")
            full = self._over_cap(nbytes)
            if full:
                self.dropped += 1
                return full
            self._slots[key] = slot
            slot.parts[part.lo] = part
            slot.covered += part.hi - part.lo
            slot.nbytes += nbytes
            self._observe()
            self.cond.notify_all()
            return None

    def put_chunk(self, msg: ReduceChunk, t: torch.Tensor, sender: str) -> str | None:
        """Add an all-reduce chunk `sender` sent; returns why it was dropped, or None."""
        poison = describe_nonfinite(t)
        with self.cond:
            refused = self._fresh(msg, "R")
            if refused is None and self.expected is not None:
                refused = self.expected.refuse_chunk(msg.step, msg.chunk, sender)
            key = (msg.round, msg.step, msg.chunk)
            if refused is None and key in self._chunks:
                refused = f"duplicate reduce chunk step {msg.step} chunk {msg.chunk}"
            if refused is None and poison:
                return self._poisoned(
                    f"reduce chunk {msg.chunk} of step {msg.step} in round {msg.round} "
                    f"from {sender!r}: non-finite values: {poison}"
                )
            refused = refused or self._over_cap(_storage_bytes([t]))
            if refused:
                self.dropped += 1
                return refused
            self._chunks[key] = t
            self._observe()
            self.cond.notify_all()
            return None

    def _poisoned(self, fault: str) -> str:
        """Refuse a plan member's poisoned part and fail the waits with it (under `cond`).

        The first fault is kept: it names the peer that broke the round.
        """
        self.dropped += 1
        if self.fault is None:
            self.fault = fault
            self.cond.notify_all()
        return fault

    def ready(self, round_no: int, kind: str) -> frozenset[int]:
        """Micro-batches of `kind` ("F", "B", "E") whose parts cover the range (under `cond`)."""
        return frozenset(
            mb
            for (r, k, mb), slot in self._slots.items()
            if r == round_no and k == kind and slot.covered == self.need
        )

    def take(self, round_no: int, kind: str, mb: int) -> list[torch.Tensor]:
        """Remove a complete task and concatenate its parts in sample order."""
        with self.cond:
            slot = self._slots.pop((round_no, kind, mb))
        parts = [slot.parts[lo] for lo in sorted(slot.parts)]
        if len(parts) == 1:
            return parts[0].tensors
        return [torch.cat(ts) for ts in zip(*(p.tensors for p in parts), strict=True)]

    # --- what the worker holds -------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of the tensors in the pool now: parts not yet taken, reduce chunks."""
        with self.cond:
            return self._resident()

    def hold_saved(self, nbytes: int) -> None:
        """Count `nbytes` of saved activations as held: a forward ran, its backward has not."""
        with self.cond:
            self.saved_bytes += nbytes
            self._observe()

    def release_saved(self, nbytes: int) -> None:
        """A backward ran: the `nbytes` its forward kept are let go."""
        with self.cond:
            if nbytes > self.saved_bytes:
                raise ValueError(
                    f"releasing {nbytes} saved bytes, only {self.saved_bytes} are held"
                )
            self.saved_bytes -= nbytes

    def _resident(self) -> int:
        """Pool bytes (under `cond`); summed afresh so that nothing kept goes uncounted."""
        parts = sum(slot.nbytes for slot in self._slots.values())
        return parts + _storage_bytes(self._chunks.values())

    def _new_peak(self) -> None:
        """Restart the peaks from what is held now (under `cond`)."""
        self.peak_bytes = self._resident() + self.saved_bytes
        self.peak_saved_bytes = self.saved_bytes

    def _observe(self) -> None:
        """Raise the peaks to what is held now (under `cond`), after anything was added."""
        self.peak_bytes = max(self.peak_bytes, self._resident() + self.saved_bytes)
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)

    def missing(self, round_no: int, kind: str, mb: int) -> set[str]:
        """Devices whose parts of task (`round_no`, `kind`, `mb`) have not come (under `cond`)."""
        if self.expected is None:
            return set()
        routes = self.expected.gradients if kind == "B" else self.expected.activations
        slot = self._slots.get((round_no, kind, mb))
        return {src for (lo, _), src in routes.items() if slot is None or lo not in slot.parts}

    def wait(
        self,
        decide: Callable[[], T | None],
        timeout_s: float,
        what: Callable[[], str],
        awaited: Callable[[], Collection[str]] | None = None,
        key: tuple[str, int] | None = None,
    ) -> T:
        """Block until `decide()` (run under the lock) returns a value, or time out.

        `awaited()` (under the lock) names the neighbours whose data would end
        the wait; past the neighbour timeout each is told to `on_silent` once
        per `key` (a phase and round; the current training round by default).
        """
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            silent: list[tuple[str, float]] = []
            with self.cond:
                epoch = self.epoch
                while True:
                    if self.aborted is not None:
                        raise RoundAbortedError(self.aborted)
                    if self.fault is not None:
                        raise PeerDataError(f"refused {self.fault}")
                    result = decide()
                    if result is not None:
                        return result
                    now = time.monotonic()
                    left = deadline - now
                    if left <= 0:
                        raise RoundTimeoutError(f"waited {timeout_s:.0f} s for {what()}")
                    quiet = self.silence.deadline(started) if awaited is not None else None
                    if quiet is not None and now >= quiet and awaited is not None:
                        phase = key or ("train", self.round)
                        silent = self.silence.due(phase, started, now, awaited())
                        if silent:
                            break  # told outside the lock, then back to waiting
                        quiet = None  # told once already: wait out the task timeout
                    self.cond.wait(left if quiet is None else min(left, quiet - now))
            self._tell_silent(epoch, silent)

    def _tell_silent(self, epoch: int, silent: list[tuple[str, float]]) -> None:
        """Tell `on_silent` of each silent neighbour; its failure never fails the wait."""
        if self.on_silent is None:
            return
        for peer, waited_s in silent:
            try:
                self.on_silent(epoch, peer, waited_s)
            except Exception:  # evidence lost is the heartbeats' to cover, not the round's
                _log.exception("could not report a silent neighbour", peer=peer)

    def take_chunk(self, round_no: int, step: int, chunk: int, timeout_s: float) -> torch.Tensor:
        """Wait for and remove one all-reduce chunk (the ring's previous device sends it)."""
        key = (round_no, step, chunk)
        prev = self.expected.ring_prev if self.expected is not None else None
        self.wait(
            lambda: True if key in self._chunks else None,
            timeout_s,
            lambda: f"reduce chunk {chunk} of step {step} in round {round_no}",
            (lambda: (prev,)) if prev is not None else None,
        )
        with self.cond:
            return self._chunks.pop(key)
