"""A job submitter cannot learn which paths exist on the coordinator's host.

The attack: SubmitJob with ``dataset.path`` set to a path of the attacker's
choosing; the refusal said "folder ... does not exist", "no data_batch_*.bin in
...", "has 100 bytes, not a multiple of ...", so a stranger with an operator key
mapped the coordinator's disk one path at a time. Here a real coordinator gets
such submissions over a real socket: every refusal must read the same, name no
path, and the reason must be in the coordinator's own log.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import DataPathError
from common.job import JobSpec
from common.messages import SubmitJob
from tests.cluster import LocalCluster
from tests.security.attacker import serving_coordinator


def _job(name: str, path: Path) -> JobSpec:
    return JobSpec.model_validate(
        {
            "job_id": f"probe-{name}",
            "model": {"name": "mlp", "options": {"hidden": 16, "depth": 2}},
            "seed": 1,
            "rounds": 1,
            "dataset": {"kind": "cifar10", "path": str(path)},
        }
    )


@pytest.mark.integration
def test_every_dataset_path_refusal_reads_the_same_and_the_reason_stays_in_the_log(
    tmp_path: Path, redis_url: str, cluster_name: str
) -> None:
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "data_batch_1.bin").write_bytes(b"\0" * 100)
    (malformed / "test_batch.bin").write_bytes(b"\0" * 100)
    probes = {
        "absent": (tmp_path / "no-such-folder", "does not exist"),
        "empty": (empty, "no data_batch_*.bin"),
        "malformed": (malformed, "has 100 bytes"),
        "a-file": (malformed / "test_batch.bin", "does not exist"),
    }
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)
    attacker = serving_coordinator(cluster)
    try:
        replies = {
            name: attacker.ask(SubmitJob(job=_job(name, path)), timeout_s=60)
            for name, (path, _) in probes.items()
        }
    finally:
        attacker.close()
        cluster.close()
    for name, reply in replies.items():
        assert not reply.ok, name
        assert reply.error == DataPathError.PUBLIC, (name, reply.error)
        assert str(tmp_path) not in reply.error
    reasons = [
        str(e["reason"])
        for e in cluster.log_events("coordinator")
        if e.get("event") == "refused a job's dataset path"
    ]
    assert len(reasons) == len(probes), reasons
    for (path, why), reason in zip(probes.values(), reasons, strict=True):
        assert str(path) in reason and why in reason, (path, why, reason)
