"""Pipeline schedules as data, and the scheduler's pure decision function.

`schedule()` gives a stage's canonical order of actions for a policy (used by
the rule checker); `next_task()` is what the worker calls on every step: given
which tasks are ready in the pool, which one runs now. Both obey the same
bound: under 1F1B at most K_p micro-batches have activations alive; under
GPipe all M do. Held-out evaluation is forwards only: `eval_schedule()` and
`next_eval()` are its pair. Shared in `common` because the planner's simulator
replays the very decisions the worker makes, so predicted and real rounds
follow one scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "POLICIES",
    "Action",
    "PoolView",
    "eval_schedule",
    "next_eval",
    "next_pair",
    "next_task",
    "parse_action",
    "schedule",
]

Kind = Literal["F", "B"]
POLICIES = ("1f1b", "gpipe")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step: forward or backward of micro-batch `mb` on `stage`."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`, e.g. "2F0" -> Action(2, "F", 0)."""
    for kind in ("F", "B"):
        stage, sep, mb = text.partition(kind)
        if sep:
            return Action(int(stage), kind, int(mb))
    raise ValueError(f"not an action: {text!r}")


def schedule(stage: int, k: int, m: int, policy: str = "1f1b") -> list[Action]:
    """Canonical action order of `stage` with K_p=`k` warm-up forwards and `m` micro-batches."""
    if policy == "gpipe":
        return [Action(stage, "F", j) for j in range(m)] + [Action(stage, "B", j) for j in range(m)]
    if policy != "1f1b":
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    warm = min(k, m)
    out = [Action(stage, "F", j) for j in range(warm)]
    next_f = warm
    for j in range(m):
        out.append(Action(stage, "B", j))
        if next_f < m:
            out.append(Action(stage, "F", next_f))
            next_f += 1
    return out


@dataclass(frozen=True)
class PoolView:
    """What the scheduler needs to know about the task pool and its own progress."""

    next_forward: int
    alive: int
    forward_ready: frozenset[int]
    backward_ready: frozenset[int]


def next_task(view: PoolView, stage: int, k: int, m: int, policy: str) -> Action | None:
    """The action to run now, or None to wait for the pool.

    Backward first (it frees memory); forwards strictly in micro-batch order
    (the order the previous stage sends them), only while fewer than K_p are
    alive under 1F1B, and under GPipe no backward until every forward ran.
    """
    all_forwarded = view.next_forward >= m
    if view.backward_ready and (policy == "1f1b" or all_forwarded):
        return Action(stage, "B", min(view.backward_ready))
    limit = k if policy == "1f1b" else m
    if not all_forwarded and view.alive < limit and view.next_forward in view.forward_ready:
        return Action(stage, "F", view.next_forward)
    return None


def next_pair(
    view: PoolView, stage: int, k: int, m: int, policy: str
) -> tuple[Action | None, Action | None]:
    """The backward and the forward to run now side by side (Duan & Wu), or (None, None).

    A device that splits its compute between a forward lane and a backward
    lane runs one of each at once. The backward is `next_task`'s; the forward
    the next one in order, ready, and allowed once that backward has started:
    its micro-batch then no longer counts against K_p (its saved tensors are
    freed while the forward runs, so the peak is one micro-batch more than
    sequential 1F1B for the length of the overlap).
    """
    all_forwarded = view.next_forward >= m
    backward = None
    if view.backward_ready and (policy == "1f1b" or all_forwarded):
        backward = Action(stage, "B", min(view.backward_ready))
    alive = view.alive - (backward is not None)
    limit = k if policy == "1f1b" else m
    forward = None
    if not all_forwarded and alive < limit and view.next_forward in view.forward_ready:
        forward = Action(stage, "F", view.next_forward)
    return backward, forward


def eval_schedule(stage: int, n: int) -> list[Action]:
    """Canonical order of an evaluation over `n` micro-batches: forwards in order."""
    return [Action(stage, "F", j) for j in range(n)]


def next_eval(view: PoolView, stage: int, n: int) -> Action | None:
    """The evaluation forward to run now, or None to wait for the pool.

    Strictly in micro-batch order, the order the previous stage sends them.
    Nothing stays alive after an evaluation forward (no backward follows), so
    no K_p bound applies; `view.alive` and `view.backward_ready` are ignored.
    """
    if view.next_forward < n and view.next_forward in view.forward_ready:
        return Action(stage, "F", view.next_forward)
    return None
