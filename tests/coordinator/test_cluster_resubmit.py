"""Submitting a job id again: a run that never committed a round is replaced, one that did is kept.

The cluster core decides from `JobChecked` (what Redis holds for the id and
the rounds its earlier run committed); the shell's count of committed rounds
is read from a real Redis: the job's record and its newest checkpoint.
"""

from __future__ import annotations

import pytest

from common.messages import JobReply
from common.records.jobs import write_job
from common.store import Store
from services.coordinator.cluster import apply, never_ran
from services.coordinator.cluster_shell import _committed
from services.coordinator.cluster_state import ClusterState, JobChecked, Log, RegisterJob, Reply
from tests.coordinator.test_cluster import PEER, job


def _checked(held: str | None, committed: int | None, replace: bool = False) -> JobChecked:
    return JobChecked(PEER, job(), replace, held, held, committed)


@pytest.mark.parametrize("held", ["failed", "cancelled", "recorded"])
def test_an_earlier_run_that_committed_no_round_is_replaced_without_asking(held: str) -> None:
    _, out = apply(ClusterState(), _checked(held, 0), 0.0)
    assert out[-1] == RegisterJob(PEER, job(), forget_old=True)
    (log,) = [c for c in out if isinstance(c, Log)]
    assert log.event == "job replaces an earlier run that committed no round"
    assert not [c for c in out if isinstance(c, Reply)]  # answered once it is registered


@pytest.mark.parametrize(
    ("held", "committed"),
    [
        ("failed", 12),  # its checkpoints are worth keeping
        ("cancelled", 1),
        ("finished", 0),
        ("checkpointed", 0),
        ("failed", None),  # not known: kept, as one that ran would be
    ],
)
def test_an_earlier_run_with_rounds_or_an_end_is_kept_and_the_refusal_says_how(
    held: str, committed: int | None
) -> None:
    assert not never_ran(_checked(held, committed))
    _, out = apply(ClusterState(), _checked(held, committed), 0.0)
    assert out == [
        Reply(
            PEER,
            JobReply(
                job_id="j1",
                ok=False,
                error=f"job_id: job j1 exists ({held}); pick another job_id, or submit with "
                "--replace to delete its checkpoints and metrics and start afresh",
            ),
        )
    ]
    _, out = apply(ClusterState(), _checked(held, committed, replace=True), 0.0)
    assert out == [RegisterJob(PEER, job(), forget_old=True)]


def test_a_fresh_id_is_registered_as_it_was() -> None:
    _, out = apply(ClusterState(), _checked(None, 0), 0.0)
    assert out == [RegisterJob(PEER, job(), forget_old=False)]


def test_the_rounds_committed_come_from_the_record_or_the_newest_checkpoint(
    store: Store,
) -> None:
    assert _committed(store, "none") == 0
    write_job(store, "waited", state="failed", round=0, error="min_workers: ...")
    assert _committed(store, "waited") == 0
    write_job(store, "ran", state="failed", round=7)
    assert _committed(store, "ran") == 7
    store.put_json(5, "ckpt", "resumed", "latest")  # a checkpoint, its record rewritten
    write_job(store, "resumed", state="cancelled", round=0)
    assert _committed(store, "resumed") == 5
    store.put_json("garbage", "ckpt", "odd", "latest")
    assert _committed(store, "odd") is None
