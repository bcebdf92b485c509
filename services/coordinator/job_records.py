"""The coordinator's records of a job in Redis: registered, its state, what an id already holds.

The coordinator is the only writer of a job's record; these functions are the
one place that writes it (and decides whether an id may be used again).
"""

from __future__ import annotations

import time

from common.checkpoint import latest_round
from common.errors import ConfigError
from common.job import JobSpec, check_job_id
from common.records.documents import put_jobspec, read_jobspec
from common.records.events import append_event
from common.records.jobs import forget_job, index_job, job_state, write_job
from common.store import Store
from services.coordinator.checked import CheckedJob, id_taken

_MAX_LAYERS = 1 << 16
"""More layers than any model placed here has: a manifest saying so is not trusted."""

__all__ = ["check_fresh", "check_resumable", "checked_layers", "existing", "register"]


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


def checked_layers(store: Store, job: JobSpec) -> int | None:
    """The model's layers if an earlier run of this very spec was checked, else None.

    A spec is registered only after its check passed, and a committed
    checkpoint's manifest names the layers that check found: when the stored
    spec is `job` unchanged and a checkpoint exists, building the model again
    would learn nothing. Anything else (a changed spec, no checkpoint yet, a
    manifest without a sane layer count) asks for the full check.
    """
    if read_jobspec(store, job.job_id) != job.model_dump(mode="json"):
        return None
    done = latest_round(store, job.job_id)
    manifest = None if done is None else store.get_json("ckpt", job.job_id, done, "manifest")
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= _MAX_LAYERS:
        return layers
    return None
