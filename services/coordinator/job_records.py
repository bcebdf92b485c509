"""The coordinator's records of a job in Redis: registered, its state, what an id already holds.

The coordinator is the only writer of a job's record; these functions are the
one place that writes it (and decides whether an id may be used again).
"""

from __future__ import annotations

import time

from common.checkpoint import latest_round
from common.errors import ConfigError
from common.job import check_job_id
from common.records.documents import put_jobspec, read_jobspec
from common.records.events import append_event
from common.records.jobs import forget_job, index_job, job_state, write_job
from common.store import Store
from services.coordinator.checked import CheckedJob, id_taken

__all__ = ["check_fresh", "check_resumable", "existing", "register"]


def register(store: Store, checked: CheckedJob, forget_old: bool = False) -> None:
    """Record the job as submitted; with `forget_old`, delete an earlier run of this id.

    Only an operator's explicit replace sets `forget_old`; otherwise an earlier
    run's checkpoints, metrics and events stay (a resumed job continues from
    them, and a new id has none).
    """
    job = checked.spec
    jid = check_job_id(job.job_id, "the job spec")  # it names keys to delete below
    if forget_old:
        forget_job(store, jid)
    put_jobspec(store, jid, job.model_dump(mode="json"))
    write_job(
        store, jid, state="submitted", submitted=time.time(), total_rounds=checked.rounds, round=0
    )
    index_job(store, jid)
    append_event(store, jid, "submitted")


def existing(store: Store, jid: str) -> str | None:
    """What Redis already holds for job id `jid` (its state, or its checkpoints), else None."""
    state = job_state(store, jid)
    if state:
        return state
    if latest_round(store, jid) is not None:
        return "checkpointed"
    if read_jobspec(store, jid) is not None:
        return "recorded"
    return None


def check_fresh(store: Store, jid: str, replace: bool, how: str) -> None:
    """Refuse to reuse job id `jid` when it has state, unless the operator said `replace`."""
    state = existing(store, jid)
    if state and not replace:
        raise ConfigError(id_taken(jid, state, how))


def check_resumable(store: Store, jid: str, total: int) -> None:
    """Refuse to resume a job whose newest checkpoint is already its last round.

    Refused like any invalid job, before it is registered or waits for
    workers, so that its record (finished, say) stays as it was.
    """
    done = latest_round(store, jid)
    if done is not None and done >= total:
        raise ConfigError(
            f"resume: job {jid} has {total} rounds and already a checkpoint of round "
            f"{done}; nothing is left to run"
        )
