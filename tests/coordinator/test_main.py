import pytest

from common.checkpoint import commit_checkpoint, save_stage
from common.exit_codes import ExitCode
from common.ports import free_port
from common.settings import CoordinatorSettings
from common.store import Store
from common.zoo import ModelSpec, build_model
from services.coordinator.main import run


@pytest.fixture
def settings(redis_url, cluster_name):
    def make(**kw):
        return CoordinatorSettings(
            bind=f"tcp://127.0.0.1:{free_port()}", redis_url=redis_url, cluster=cluster_name, **kw
        )

    return make


def test_job_with_unknown_key_is_a_config_error(tmp_path, settings, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("job_id: x\nmodel: {name: small_cnn}\nround: 5\n")
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert run(settings(job=job, plan=str(plan))) == ExitCode.CONFIG
    assert "round" in "".join(capsys.readouterr())


def test_plan_from_redis_must_exist(tmp_path, settings, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("job_id: nothing-stored\nmodel: {name: small_cnn}\n")
    assert run(settings(job=job, plan="redis")) == ExitCode.CONFIG
    assert "no plan stored in Redis for job nothing-stored" in "".join(capsys.readouterr())


def test_plan_that_does_not_fit_model_is_a_config_error(tmp_path, settings, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("job_id: j\nmodel: {name: small_cnn}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "global_batch: 8\nmicrobatches: 2\n"
        "stages:\n  - {start: 0, end: 3, devices: [{device: a}]}\n"
    )
    assert run(settings(job=job, plan=str(plan))) == ExitCode.CONFIG
    assert "stages cover layers [0, 3); the model has 7" in "".join(capsys.readouterr())


def test_job_and_plan_go_together(settings, tmp_path):
    assert run(settings(plan="x.json")) == ExitCode.CONFIG


def test_resume_past_the_end_is_refused_before_anything_starts(
    tmp_path, settings, redis_url, cluster_name, capsys
):
    job = tmp_path / "job.yaml"
    job.write_text("job_id: done\nmodel: {name: mlp}\nrounds: 3\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "global_batch: 8\nmicrobatches: 2\n"
        "stages:\n  - {start: 0, end: 4, devices: [{device: a}]}\n"
    )
    store = Store(redis_url, cluster_name)
    model = build_model(ModelSpec(name="mlp"), 0).full()
    save_stage(store, "done", 3, model, None, 0)
    commit_checkpoint(store, "done", 3, len(model))
    store.set_fields({"state": "finished", "round": 3}, "job", "done")
    # no worker runs, and the join timeout is long: the refusal must not wait for one
    code = run(settings(job=job, plan=str(plan), resume=True, join_timeout_s=60))
    assert code == ExitCode.CONFIG
    assert (
        "resume: job done has 3 rounds and already a checkpoint of round 3; nothing is left to run"
        in "".join(capsys.readouterr())
    )
    # refused like any invalid job: the record of what it did stays as it was
    assert store.get_fields("job", "done") == {"state": "finished", "round": 3}
    store.close()
