import pytest

from common.exit_codes import ExitCode
from common.settings import CoordinatorSettings
from services.coordinator.main import run
from tests.cluster import free_port


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
