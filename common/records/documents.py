"""A job's JSON documents: ``jobspec:<id>`` (what was submitted), ``plan:<id>``, ``cluster:<id>``.

The spec is stored as submitted (a training `JobSpec` or a serving `ServeSpec`,
told apart by its reader), so it stays a plain document here: parsing it needs
the job schema, which loads torch. The plan and the cluster the planner was
given are typed.
"""

from __future__ import annotations

from typing import Any

from common.ids import check_job_id
from common.plan import Plan
from common.profile import ClusterSpec
from common.store import Store

__all__ = ["put_cluster", "put_jobspec", "put_plan", "read_cluster", "read_jobspec", "read_plan"]


def put_jobspec(store: Store, jid: str, spec: dict[str, Any]) -> None:
    """Store the job's spec document (its `model_dump(mode="json")`)."""
    store.put_json(spec, "jobspec", check_job_id(jid, "a job spec's writer"))


def read_jobspec(store: Store, jid: str) -> dict[str, Any] | None:
    """The job's spec document, or None when none is stored."""
    doc = store.get_json("jobspec", check_job_id(jid, "a job spec's reader"))
    return None if doc is None else dict(doc)


def put_plan(store: Store, jid: str, plan: Plan) -> None:
    """Store the job's plan (what a restarted coordinator resumes on)."""
    store.put_json(plan.model_dump(mode="json"), "plan", check_job_id(jid, "a plan's writer"))


def read_plan(store: Store, jid: str) -> Plan | None:
    """The job's stored plan, or None; pydantic's ValidationError if it is malformed."""
    doc = store.get_json("plan", check_job_id(jid, "a plan's reader"))
    return None if doc is None else Plan.model_validate(doc)


def put_cluster(store: Store, jid: str, cluster: ClusterSpec) -> None:
    """Store the cluster the job was planned for (its devices and their profiles)."""
    store.put_json(cluster.model_dump(mode="json"), "cluster", check_job_id(jid, "a writer"))


def read_cluster(store: Store, jid: str) -> ClusterSpec | None:
    """The cluster the job was planned for, or None; ValidationError if it is malformed."""
    doc = store.get_json("cluster", check_job_id(jid, "a cluster's reader"))
    return None if doc is None else ClusterSpec.model_validate(doc)
