"""User code runs only from modules the operator allow-listed, and never kills a service.

Attacks from the issue, over a real DEALER against a real coordinator process: a
SubmitJob naming ``os:abort``, ``sys:exit`` or any importable callable; a factory the
operator did allow that exits or raises KeyboardInterrupt; ``num_classes: 1e12``. Each
gets a JobReply naming the field at fault, and the coordinator answers the next request.
Unit tests pin the allow-list itself and the setting that carries it.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp

from common.errors import ConfigError
from common.exit_codes import ExitCode
from common.job import MAX_CLASSES, JobSpec
from common.messages import CancelJob, SubmitJob
from common.settings import CoordinatorSettings, WorkerSettings
from common.zoo import ModelSpec, build_model
from services.coordinator.checks import check_job
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage
from tests.security.attacker import Attacker, alive, serving_coordinator

JOB = JobSpec.model_validate({"job_id": "probe", "model": {"name": "mlp"}})
"""A valid job without model options (a custom model's option check would come before
its import); each attack rewrites one of its fields on the wire."""

EVIL = '''
import pathlib
import sys

from torch import nn

from common.zoo import model_factory

MARK = pathlib.Path({mark!r})
if {exit_on_import!r}:
    sys.exit(3)


@model_factory
def touch():
    """Leaves a trace when called: proof that a job ran code."""
    MARK.write_text("called")
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))


@model_factory
def exits():
    sys.exit(0)


@model_factory
def interrupts():
    raise KeyboardInterrupt


@model_factory
def fine():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
'''


def write_module(where: Path, exit_on_import: bool = False) -> tuple[str, Path]:
    """A fresh module of factories in `where`; its name and the file `touch` writes."""
    name = f"evil_{uuid.uuid4().hex[:8]}"
    mark = where / f"{name}.called"
    text = EVIL.format(mark=str(mark), exit_on_import=exit_on_import)
    (where / f"{name}.py").write_text(text)
    return name, mark


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path for generated modules, forgotten afterwards."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("evil_"):
            del sys.modules[name]


# --- the allow-list, in-process ------------------------------------------------------


@pytest.mark.parametrize("name", ["os:abort", "sys:exit", "builtins:breakpoint"])
def test_a_module_outside_the_allow_list_is_refused_naming_field_and_setting(name):
    with pytest.raises(ConfigError) as info:
        build_model(ModelSpec(name=name), seed=0)
    message = str(info.value)
    assert f"model.name {name!r}" in message
    assert "model_modules setting (ASTEROID_MODEL_MODULES / --model-modules" in message
    assert "allowed: none" in message


def test_a_refused_module_is_never_imported_nor_called(modules):
    name, mark = write_module(modules)
    with pytest.raises(ConfigError, match="is not in this service's model_modules"):
        build_model(ModelSpec(name=f"{name}:touch"), seed=0, allowed_modules=["other"])
    assert name not in sys.modules
    assert not mark.exists()
    # the same module, allowed by the operator, builds
    model = build_model(ModelSpec(name=f"{name}:touch"), seed=0, allowed_modules=[name])
    assert len(model.layers) == 2 and mark.exists()


def test_the_allow_list_is_exact_a_package_does_not_admit_its_submodules():
    with pytest.raises(ConfigError, match=r"module 'os\.path' is not in"):
        build_model(ModelSpec(name="os.path:join"), seed=0, allowed_modules=["os"])


@pytest.mark.parametrize(
    ("factory", "raised"), [("exits", "SystemExit(0)"), ("interrupts", "KeyboardInterrupt()")]
)
def test_what_an_allowed_factory_raises_becomes_a_config_error(modules, factory, raised):
    name, _ = write_module(modules)
    with pytest.raises(ConfigError, match=f"factory raised {re.escape(raised)}"):
        build_model(ModelSpec(name=f"{name}:{factory}"), seed=0, allowed_modules=[name])


def test_a_module_that_exits_while_imported_is_a_config_error(modules):
    name, _ = write_module(modules, exit_on_import=True)
    with pytest.raises(ConfigError, match=rf"cannot import module '{name}': SystemExit\(3\)"):
        build_model(ModelSpec(name=f"{name}:fine"), seed=0, allowed_modules=[name])


def test_check_job_passes_the_services_allow_list_only(modules):
    name, _ = write_module(modules)
    job = JOB.model_copy(update={"model": ModelSpec(name=f"{name}:fine")})
    with pytest.raises(ConfigError, match=r"^model: model.name .* is not in"):
        check_job(job)
    assert check_job(job, [name]).rounds == 10


def test_the_setting_comes_from_the_environment_or_a_flag_and_defaults_to_none(monkeypatch):
    assert WorkerSettings().model_modules == ()
    monkeypatch.setenv("ASTEROID_MODEL_MODULES", "lab.models, lab.more")
    assert WorkerSettings().model_modules == ("lab.models", "lab.more")
    monkeypatch.setenv("ASTEROID_MODEL_MODULES", '["lab.json"]')
    assert CoordinatorSettings().model_modules == ("lab.json",)
    flags = CliApp.run(CoordinatorSettings, cli_args=["--model-modules", "a.b,c"])
    assert flags.model_modules == ("a.b", "c")


FINITE = {"kind": "synthetic", "train_size": 8}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": {"name": "mlp", "num_classes": 1e12}}, "model"),
        ({"model": {"name": "mlp", "num_classes": MAX_CLASSES + 1}}, "model"),
        ({"global_batch": 2**40}, "global_batch"),
        ({"epochs": float("inf"), "global_batch": 2, "dataset": FINITE}, "epochs"),
        ({"optimizer": {"lr": float("inf")}}, "optimizer.lr"),
    ],
)
def test_absurd_numbers_are_refused_by_the_job_model(change, field):
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({**JOB.model_dump(), **change})
    assert ".".join(map(str, info.value.errors()[0]["loc"])) == field


# --- over the wire, against a coordinator process --------------------------------------


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget, modules):
    c = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    c.env["PYTHONPATH"] = os.pathsep.join([str(modules), c.env.get("PYTHONPATH", "")])
    yield c
    c.close()


def _still_serving(cluster: LocalCluster, attacker: Attacker) -> None:
    alive(cluster)
    reply = attacker.ask(CancelJob(job_id="nobody"))
    assert reply.error == "job nobody is not queued or running (unknown)", reply


@pytest.mark.integration
def test_a_job_cannot_make_the_coordinator_import_or_run_code(cluster, modules):
    name, mark = write_module(modules)
    attacker = serving_coordinator(cluster)
    try:
        for model in ("os:abort", "sys:exit", f"{name}:touch"):
            reply = attacker.ask(SubmitJob(job=JOB), job__model__name=model)
            assert not reply.ok
            assert reply.error.startswith(f"model: model.name {model!r}: module"), reply
            assert "model_modules setting" in reply.error
            _still_serving(cluster, attacker)
        assert not mark.exists(), "the coordinator ran a job's code"
    finally:
        attacker.close()


@pytest.mark.integration
def test_allowed_user_code_that_exits_or_interrupts_fails_the_job_not_the_service(cluster, modules):
    name, _ = write_module(modules)
    cluster.env["ASTEROID_MODEL_MODULES"] = name
    attacker = serving_coordinator(cluster)
    try:
        for factory, raised in (("exits", "SystemExit(0)"), ("interrupts", "KeyboardInterrupt()")):
            reply = attacker.ask(SubmitJob(job=JOB), job__model__name=f"{name}:{factory}")
            assert not reply.ok
            assert reply.error == (
                f"model: custom model '{name}:{factory}': factory raised {raised}"
            ), reply
            _still_serving(cluster, attacker)
        # the allowed module's well-behaved factory is accepted
        reply = attacker.ask(SubmitJob(job=JOB), job__model__name=f"{name}:fine")
        assert reply.ok, reply
    finally:
        attacker.close()


@pytest.mark.integration
def test_num_classes_1e12_is_refused_and_the_coordinator_stays_up(cluster):
    attacker = serving_coordinator(cluster)
    try:
        reply = attacker.ask(SubmitJob(job=JOB), job__model__num_classes=1e12)
        assert not reply.ok
        assert "num_classes must be in [1, 100000], got 1000000000000" in reply.error, reply
        assert "'submit_job'" in reply.error and reply.error.endswith(" at submit_job.job.model")
        _still_serving(cluster, attacker)
    finally:
        attacker.close()


def _custom_job(job_id: str, model: str) -> dict[str, object]:
    return {
        "job_id": job_id,
        "model": {"name": model},
        "global_batch": 4,
        "rounds": 2,
        "dataset": {"kind": "synthetic", "eval_size": 8},
    }


@pytest.mark.integration
def test_workers_build_user_models_only_from_their_own_allow_list(cluster, modules, store):
    name, _ = write_module(modules)
    cluster.start_workers(["a"])  # started without the setting: zoo models only
    cluster.env["ASTEROID_MODEL_MODULES"] = name
    cluster.start_workers(["b"])

    # the coordinator allows the module, worker a does not: a's refusal fails the job
    plan = {"global_batch": 4, "microbatches": 1, "stages": [stage(0, 2, "a")]}
    job = cluster.write("refused.yaml", _custom_job("refused", f"{name}:fine"))
    args = ["--bind", cluster.addr, "--job", str(job), "--plan", str(cluster.write("a.json", plan))]
    cluster.spawn("coord-refused", ["-m", "services.coordinator.main", *args])
    assert cluster.wait("coord-refused", 120) == ExitCode.JOB_FAILED, cluster.log("coord-refused")
    error = str(store.get_fields("job", "refused")["error"])
    assert error.startswith("worker a failed"), (error, cluster.log("a"))
    assert f"module {name!r} is not in this service's model_modules setting" in error

    # worker b, allowed like the coordinator, trains it
    plan = {"global_batch": 4, "microbatches": 1, "stages": [stage(0, 2, "b")]}
    code = cluster.run(_custom_job("allowed", f"{name}:fine"), plan, 120)
    assert code == ExitCode.OK, cluster.log("coordinator")
    assert store.get_fields("job", "allowed")["state"] == "finished"
