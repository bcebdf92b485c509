"""A resumed job whose unchanged spec was checked and checkpointed builds no model again.

The model check starts a process that imports torch: on a loaded board that is
seconds during which a restarted coordinator's socket (and the workers coming
back to it) wait unread. A spec is registered only once its check passed and a
checkpoint's manifest names the layers that check found, so the resume takes
them from Redis; anything else (a changed spec, no checkpoint, a manifest
without a sane layer count) gets the full check. Real Redis, a real
coordinator; only the job's loop is replaced, so that the test sees what it
would run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from common.job import JobSpec
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.store import Store
from services.coordinator import job_records, service
from services.coordinator.checks import CheckedJob, check_data, check_job
from services.coordinator.service import Coordinator

SPEC = {
    "job_id": "again",
    "model": {"name": "small_cnn"},
    "seed": 3,
    "rounds": 6,
    "dataset": {"kind": "synthetic", "train_size": 64},
}


@pytest.fixture
def coord(redis_url: str, cluster_name: str) -> Iterator[Coordinator]:
    settings = CoordinatorSettings(
        bind=f"tcp://127.0.0.1:{free_port()}", redis_url=redis_url, cluster=cluster_name
    )
    coordinator = Coordinator(settings)
    yield coordinator
    coordinator.close()


def _checkpointed(store: Store, checked: CheckedJob, manifest: dict[str, Any]) -> None:
    """`checked` registered as a run that committed a checkpoint of round 0 with `manifest`."""
    job_records.register(store, checked)
    store.put_jsons(
        [
            (("ckpt", checked.job_id, 0, "manifest"), manifest),
            (("ckpt", checked.job_id, "latest"), 0),
        ]
    )


def _resumed(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch, job: JobSpec
) -> tuple[CheckedJob, list[str]]:
    """What `run_job(resume=True)` would run, and the jobs whose model it built."""
    built: list[str] = []
    ran: list[CheckedJob] = []

    def counting_check(spec: JobSpec, *args: Any) -> CheckedJob:
        built.append(spec.job_id)
        return check_job(spec, *args)

    def fake_run(checked: CheckedJob, *_: Any) -> Any:
        ran.append(checked)

    monkeypatch.setattr(service, "check_job", counting_check)
    monkeypatch.setattr(coord, "_run", fake_run)
    coord.run_job(job, resume=True)
    return ran[0], built


def test_resuming_an_unchanged_checkpointed_job_builds_no_model(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobSpec.model_validate(SPEC)
    first = check_job(job)
    _checkpointed(coord.store, first, {"round": 0, "layers": first.layers, "time": 0.0})
    checked, built = _resumed(coord, monkeypatch, job)
    assert built == []
    assert checked == first  # the same rounds, data sizes and layers as the full check


def test_a_changed_spec_is_checked_in_full_on_resume(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobSpec.model_validate(SPEC)
    _checkpointed(coord.store, check_data(job, (), 4), {"round": 0, "layers": 4, "time": 0.0})
    changed = JobSpec.model_validate({**SPEC, "seed": 4})
    checked, built = _resumed(coord, monkeypatch, changed)
    assert built == ["again"]
    assert checked.spec.seed == 4


def test_the_layers_come_only_from_an_unchanged_spec_and_a_sane_manifest(store: Store) -> None:
    job = JobSpec.model_validate(SPEC)
    assert job_records.checked_layers(store, job) is None  # nothing stored
    job_records.register(store, check_data(job, (), 4))
    assert job_records.checked_layers(store, job) is None  # no checkpoint yet
    for bad in (0, -1, True, "4", 4.0, 1 << 20, None):
        _checkpointed(store, check_data(job, (), 4), {"round": 0, "layers": bad})
        assert job_records.checked_layers(store, job) is None, bad
    _checkpointed(store, check_data(job, (), 4), {"round": 0, "layers": 4})
    assert job_records.checked_layers(store, job) == 4
    assert job_records.checked_layers(store, JobSpec.model_validate({**SPEC, "rounds": 7})) is None
