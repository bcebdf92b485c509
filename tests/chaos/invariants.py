"""What a chaos run must show at its end, as pure checks over what it recorded.

- the job finished (the coordinator exited 0, the job's record says finished);
- the ledger: the effective rounds (rollbacks applied) are 0..R-1 once each,
  their positions tile [0, R*B) without gap or overlap, and every sample of
  every complete epoch was trained exactly once (the last, partial epoch: no
  sample twice);
- the final weights equal single-process training from the same seed within
  `WEIGHT_TOLERANCE` (Adam at a small learning rate; see `tests.chaos.run`);
- no growth: for every process that lived through the run, its resident memory,
  open files and threads at the end are within a stated tolerance of its level
  after warm-up (`GrowthRule`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.ledger import effective_rounds
from tests.chaos.sampler import Sample
from tests.reference import WEIGHT_TOLERANCE, weight_difference


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def finished(exit_code: int | None, state: str | None) -> Check:
    ok = exit_code == 0 and state == "finished"
    return Check("job finished", ok, f"coordinator exit code {exit_code}, job state {state!r}")


def ledger(entries: Iterable[Mapping[str, Any]], rounds: int, epoch_samples: int) -> Check:
    """Every round once, positions tiled, every sample of every epoch exactly once."""
    name = "ledger: every sample of every epoch exactly once"
    try:
        kept = effective_rounds([dict(e) for e in entries])
    except ValueError as exc:
        return Check(name, False, str(exc))
    got = [int(e["round"]) for e in kept]
    if got != list(range(rounds)):
        missing = sorted(set(range(rounds)) - set(got))
        return Check(name, False, f"rounds {got[:5]}... ({len(got)}), missing {missing[:10]}")
    at = 0
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for e in kept:
        lo, hi = (int(p) for p in e["positions"])
        if lo != at:
            return Check(name, False, f"round {e['round']} starts at position {lo}, not {at}")
        samples = [int(s) for s in e["samples"]]
        if len(samples) != hi - lo:
            return Check(name, False, f"round {e['round']}: {len(samples)} samples for {hi - lo}")
        for pos, sample in zip(range(lo, hi), samples, strict=True):
            per_epoch[pos // epoch_samples].append(sample)
        at = hi
    complete = at // epoch_samples
    for epoch, samples in sorted(per_epoch.items()):
        if epoch < complete and sorted(samples) != list(range(epoch_samples)):
            twice = sorted({s for s in samples if samples.count(s) > 1})
            lost = sorted(set(range(epoch_samples)) - set(samples))
            return Check(name, False, f"epoch {epoch}: twice {twice[:10]}, never {lost[:10]}")
        if len(set(samples)) != len(samples):
            return Check(name, False, f"epoch {epoch} (partial): a sample twice")
    return Check(name, True, f"{rounds} rounds, {complete} complete epochs of {epoch_samples}")


def weights(
    got: Mapping[str, torch.Tensor] | None,
    ref: Mapping[str, torch.Tensor],
    tol: float = WEIGHT_TOLERANCE,
) -> Check:
    name = "final weights equal single-process training"
    if got is None:
        return Check(name, False, "no final checkpoint")
    try:
        key, diff = weight_difference(got, ref)
    except AssertionError as exc:
        return Check(name, False, str(exc))
    return Check(name, diff <= tol, f"max-abs difference {diff:.3g} ({key}), allowed {tol:g}")


@dataclass(frozen=True)
class GrowthRule:
    """How much a process may grow from its level after warm-up to its level at the end.

    A level is the median of `window` samples (one sample is noise: a
    collection, a message in flight). RSS may grow by `rss_frac` of the level
    plus `rss_abs_kib`: a worker that takes over more layers after a re-plan
    legitimately holds more (seen: 324 to 460 MiB on loopback), and torch's
    allocator and Python's heap keep what they once used. Open files may grow
    by `fds_abs`: a worker's files follow its neighbours (a ZeroMQ connection is
    a socket plus its mailbox), and a re-plan or a join can give it several
    more (seen: +16 for a spare that joined). Threads by `threads_abs` (a worker
    assigned a stage starts its pool's three). A leak per round outruns these
    on any run; a socket leaked per event shows on the long run's 25 events
    (a short run's six stay inside the margin: that is the long run's job).
    Processes that lived less than `min_life_s` are not judged (too few samples).
    """

    warmup_s: float = 10.0
    window: int = 5
    rss_frac: float = 0.25
    rss_abs_kib: int = 64 * 1024
    fds_abs: int = 24
    threads_abs: int = 4
    min_life_s: float = 30.0


def _work_start(
    name: str, first: float, last: float, work_starts: Mapping[str, Sequence[float]]
) -> float:
    """The first work start of process `name` within its life [first, last], else -inf."""
    base = name.partition("@")[0]
    starts = [
        t
        for key, ts in work_starts.items()
        if base == key or base.startswith((f"{key}.", f"{key}-"))
        for t in ts
        if first <= t <= last
    ]
    return min(starts, default=-math.inf)


def growth(
    samples: Sequence[Sample],
    warm: float,
    rule: GrowthRule | None = None,
    until: float = math.inf,
    work_starts: Mapping[str, Sequence[float]] | None = None,
) -> Check:
    """Each process's level at the end against its level after warm-up (`GrowthRule`).

    `warm`: when the job committed its first round; `until`: its last commit.
    Samples after it are left out: a process shutting down closes its files
    and threads, which would hide a leak behind its exit. `work_starts`: when
    a process that came later went to work (a joined device's first committed
    round with it, a restarted coordinator's first), keyed by its name before
    "@" or a prefix of it ending at "." or "-" ("j1" is "j1.worker@7" and
    "j1-2"): its level is taken from then, not from its first samples, which
    show it starting (a coordinator's 3 files) or idle until its join (a
    worker with no stage: 1 thread, 3 files), and would flag its work as growth.
    """
    rule = rule or GrowthRule()
    by_name: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.t <= until:
            by_name[s.name].append(s)
    grew, judged = [], []
    for name, seq in sorted(by_name.items()):
        seq.sort(key=lambda s: s.t)
        began = _work_start(name, seq[0].t, seq[-1].t, work_starts or {})
        start = max(warm, seq[0].t + rule.warmup_s, began)
        after = [s for s in seq if s.t >= start]
        if len(after) < 2 * rule.window or after[-1].t - seq[0].t < rule.min_life_s:
            continue
        judged.append(name)
        base, end = after[: rule.window], after[-rule.window :]
        for what, frac, margin in (
            ("rss_kib", rule.rss_frac, rule.rss_abs_kib),
            ("fds", 0.0, rule.fds_abs),
            ("threads", 0.0, rule.threads_abs),
        ):
            b = statistics.median(getattr(s, what) for s in base)
            e = statistics.median(getattr(s, what) for s in end)
            if e > b * (1 + frac) + margin:
                grew.append(f"{name} {what} {b:g} -> {e:g}")
    detail = "; ".join(grew) if grew else f"{len(judged)} processes judged: {', '.join(judged)}"
    return Check("no memory, file or thread growth", not grew and bool(judged), detail)
