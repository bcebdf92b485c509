"""A federation's keys: the ``fl:<id>`` hash, the ``fl-model:<id>`` blob, ``fl-metrics:<id>``.

The federation service owns them; `starts` in the hash counts its starts, so
a restarted federation numbers its rounds past the last one's.
"""

from __future__ import annotations

from common.ids import check_job_id
from common.store import Store

__all__ = ["count_start", "forget_federation"]


def forget_federation(store: Store, fid: str) -> None:
    """Delete an earlier run of federation `fid`: its hash, its model blob, its metrics."""
    fid = check_job_id(fid, "a federation's keys")
    store.delete(store.key("fl", fid), store.key("fl-model", fid), store.key("fl-metrics", fid))
    store.delete_prefix("fl-model", fid, "")


def count_start(store: Store, fid: str) -> int:
    """Count one more start of federation `fid`; how many there have been, this one included."""
    return store.increment_field("starts", "fl", check_job_id(fid, "a federation's keys"))
