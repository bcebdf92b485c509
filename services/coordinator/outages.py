"""What a Redis outage means to a running job, as pure functions of its state.

The shell never waits for Redis inside an effect: a Redis step that fails
with an outage is held, with every command after it, and the core is told
(`StoreDown`); once the held step goes through, `StoreBack`. Meanwhile the
job stands still where the held write is (at a round boundary: the next
round's commands are behind its commit), so the step under way cannot time
out or look hung for want of commands it never got; its network events are
still judged (a device lost during the outage is found, and its recovery
queues behind the held write). An outage longer than `redis_outage_s` fails
the job with the message `Store.ride_out` gives.
"""

from __future__ import annotations

from dataclasses import replace

from services.coordinator.core import Log, Wait
from services.coordinator.job_state import Out, Run, fail
from services.coordinator.store_outage import StoreBack, StoreDown, unreachable

__all__ = ["gave_up", "noted", "waited"]


def noted(run: Run, event: StoreDown | StoreBack, now: float) -> Out:
    """Redis went away (its first failure is kept) or came back (the step starts over from now)."""
    if isinstance(event, StoreDown):
        if run.outage is not None:
            return run, []
        why = {
            "redis": event.where,
            "waiting": event.what,
            "patience_s": run.limits.redis_outage_s,
            "error": event.error,
        }
        run = replace(run, outage=event, wait=_rearmed(run.wait, now))
        return run, [Log("warning", "Redis unreachable; waiting for it", why)]
    down = run.outage
    if down is None:
        return run, []
    # the step's commands go out only now: its deadline, watchdog and duration count from here
    live = run.wait is not None and not run.wait.done
    run = replace(
        run, outage=None, wait=_rearmed(run.wait, now), step_t0=now if live else run.step_t0
    )
    back = {"redis": down.where, "waited": down.what, "after_s": round(now - down.since, 2)}
    return run, [Log("info", "Redis is back", back)]


def waited(run: Run, now: float) -> Run:
    """Time passed during an outage: past the patience the job fails, else its step stands still.

    Even a finished job fails: its last commit is among the held writes.
    """
    down = run.outage
    if down is None:
        return run
    patience = run.limits.redis_outage_s
    if now - down.since >= patience:
        return fail(run, unreachable(down, now, patience))[0]
    return replace(run, wait=_rearmed(run.wait, now))


def _rearmed(wait: Wait | None, now: float) -> Wait | None:
    """The wait as if it began at `now` (its deadline and watchdog count from then)."""
    if wait is None or wait.done:
        return wait
    return replace(wait, started=now)


def gave_up(run: Run) -> bool:
    """The job failed because Redis stayed away past the patience (`waited`)."""
    down = run.outage
    return (
        run.phase == "failed"
        and down is not None
        and run.outcome.startswith(f"Redis at {down.where} unreachable for ")
    )
