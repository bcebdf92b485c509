"""One SubmitJob cannot take the coordinator down: bounded options, sized models, a sandbox.

Attacks from the issue, over a real DEALER against a real coordinator process:
``mlp`` with ``depth`` or ``hidden`` of 300000 (which froze, or OOM-killed, the
coordinator while it built the model in its message loop); a model inside every
option's ceiling whose size is still absurd; an allow-listed module's helper
(``clear_cache``) named as if it were a factory. Each is refused with an error naming
what is wrong, the coordinator's peak memory does not move, and it answers the next
request. The sandbox itself is pinned in-process beside them.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.job import JobSpec
from common.messages import CancelJob, SubmitJob
from common.zoo import ModelSpec, build_model
from services.coordinator.model_probe import ModelFacts, ProbeLimits, probe_model
from tests.cluster import LocalCluster
from tests.security.attacker import Attacker, alive, serving_coordinator

LAB = '''
import pathlib
import time

from torch import nn

from common.zoo import model_factory

CLEARED = pathlib.Path({cleared!r})


@model_factory
def fine():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))


@model_factory
def huge():
    """About 800 MB of weights, and no option says so: only building it tells."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1 << 16), nn.Linear(1 << 16, 10))


@model_factory
def slow():
    time.sleep(60)


@model_factory
def loud():
    raise RuntimeError("x" * (1 << 20))


def clear_cache():
    """A helper of the allowed module, not a factory: a job naming it must not run it."""
    CLEARED.write_text("cleared")
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
'''

JOB = JobSpec.model_validate({"job_id": "probe", "model": {"name": "mlp"}})

PEAK_GROWTH = 200 << 20
"""How much the coordinator's peak resident memory may grow while it refuses models
of 800 MB and more (what it grows by while answering at all)."""


def write_lab(where: Path) -> tuple[str, Path]:
    """A fresh operator module in `where`; its name and the file `clear_cache` writes."""
    name = f"lab_{uuid.uuid4().hex[:8]}"
    cleared = where / f"{name}.cleared"
    (where / f"{name}.py").write_text(LAB.format(cleared=str(cleared)))
    return name, cleared


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path for generated modules, forgotten afterwards."""
    before = set(sys.modules)
    folder = tmp_path / "modules"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith("lab_"):
            del sys.modules[name]


@pytest.fixture
def cluster(tmp_path, redis_url, cluster_name, budget, modules):
    c = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    c.env["PYTHONPATH"] = os.pathsep.join([str(modules), c.env.get("PYTHONPATH", "")])
    yield c
    c.close()


def peak_rss(pid: int) -> int:
    """Peak resident bytes of process `pid` so far (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmHWM for process {pid}")


def still_serving(cluster: LocalCluster, attacker: Attacker, job_id: str) -> None:
    """The coordinator is up, answers a cancel, and accepts a valid submission."""
    alive(cluster)
    reply = attacker.ask(CancelJob(job_id="nobody"))
    assert reply.error == "job nobody is not queued or running (unknown)", reply
    reply = attacker.ask(SubmitJob(job=JOB.model_copy(update={"job_id": job_id})))
    assert reply.ok, reply


# --- the sandbox, in-process ------------------------------------------------------------


def test_a_model_is_built_in_a_child_and_only_its_sizes_come_back():
    facts = probe_model(ModelSpec(name="mlp", options={"hidden": 8, "depth": 1}), seed=0)
    assert facts == ModelFacts(layers=2, parameters=24674, parameter_bytes=4 * 24674)


def test_a_build_beyond_the_memory_limit_is_refused_and_the_caller_does_not_grow():
    before = peak_rss(os.getpid())
    # 30000 wide: 1 G parameters, inside every ceiling and the count bound
    spec = ModelSpec(name="mlp", options={"hidden": 30000, "depth": 2})
    with pytest.raises(ConfigError, match=r"cannot be built within the 256 MiB a check may use"):
        probe_model(spec, seed=0, limits=ProbeLimits(memory_bytes=256 << 20))
    assert peak_rss(os.getpid()) - before < PEAK_GROWTH


def test_a_build_past_its_deadline_is_stopped(modules):
    name, _ = write_lab(modules)
    spec = ModelSpec(name=f"{name}:slow")
    with pytest.raises(ConfigError, match=r"building it took longer than 0.5 s"):
        probe_model(spec, seed=0, allowed_modules=[name], limits=ProbeLimits(timeout_s=0.5))
    # the server that ran it still answers
    assert probe_model(ModelSpec(name="mlp", options={"depth": 0}), seed=0).layers == 1


def test_what_user_code_raises_comes_back_cut_short(modules):
    name, _ = write_lab(modules)
    with pytest.raises(ConfigError, match=r"factory raised RuntimeError\('xxx") as info:
        probe_model(ModelSpec(name=f"{name}:loud"), seed=0, allowed_modules=[name])
    assert len(str(info.value)) <= 4000


def test_a_helper_of_an_allowed_module_is_refused_and_never_called(modules):
    name, cleared = write_lab(modules)
    spec = ModelSpec(name=f"{name}:clear_cache")
    for check in (
        lambda: build_model(spec, seed=0, allowed_modules=[name]),
        lambda: probe_model(spec, seed=0, allowed_modules=[name]),
    ):
        with pytest.raises(
            ConfigError, match=r"'clear_cache' in module .* is not declared a model"
        ):
            check()
    assert not cleared.exists()
    assert probe_model(ModelSpec(name=f"{name}:fine"), 0, [name]).parameters == 30730


# --- over the wire, against a coordinator process --------------------------------------


@pytest.mark.integration
def test_mlp_depth_or_hidden_300000_is_refused_at_once_naming_the_option(cluster):
    attacker = serving_coordinator(cluster)
    try:
        for option, bound in (("depth", "[0, 1024]"), ("hidden", "[1, 65536]")):
            reply = attacker.ask(SubmitJob(job=JOB), job__model__options={option: 300_000})
            assert not reply.ok
            assert (
                f"model 'mlp': options.{option} must be an integer in {bound}, got 300000"
                in reply.error
            ), reply
            assert reply.error.endswith(" at submit_job.job.model"), reply
            still_serving(cluster, attacker, f"after-{option}")
    finally:
        attacker.close()


@pytest.mark.integration
def test_a_huge_model_is_refused_without_the_coordinator_growing(cluster, modules):
    name, _ = write_lab(modules)
    cluster.env["ASTEROID_MODEL_MODULES"] = name
    cluster.env["ASTEROID_MODEL_CHECK_MEMORY_MB"] = "256"
    attacker = serving_coordinator(cluster)
    try:
        still_serving(cluster, attacker, "warm")  # what answering costs is in the baseline
        pid = cluster.procs["coordinator"].pid
        before = peak_rss(pid)

        # inside every option's ceiling, 4 T parameters by count: refused as it is decoded
        options = {"hidden": 65536, "depth": 1024}
        reply = attacker.ask(SubmitJob(job=JOB), job__model__options=options)
        assert not reply.ok
        assert "model 'mlp' would have 4394020634634 parameters" in reply.error, reply

        # a user factory's size is only known by building it: the child runs out, not us
        reply = attacker.ask(SubmitJob(job=JOB), job__model__name=f"{name}:huge")
        assert not reply.ok
        assert reply.error.startswith(f"model: custom model '{name}:huge': factory raised"), reply
        assert "can't allocate memory" in reply.error, reply

        still_serving(cluster, attacker, "after-huge")
        assert peak_rss(pid) - before < PEAK_GROWTH, cluster.log("coordinator")
    finally:
        attacker.close()


@pytest.mark.integration
def test_an_allowed_modules_helper_is_refused_and_never_runs(cluster, modules):
    name, cleared = write_lab(modules)
    cluster.env["ASTEROID_MODEL_MODULES"] = name
    attacker = serving_coordinator(cluster)
    try:
        reply = attacker.ask(SubmitJob(job=JOB), job__model__name=f"{name}:clear_cache")
        assert not reply.ok
        assert reply.error == (
            f"model: custom model '{name}:clear_cache': 'clear_cache' in module {name!r} is "
            "not declared a model factory (decorate it with common.zoo.model_factory); "
            "nothing was called"
        ), reply
        still_serving(cluster, attacker, "after-helper")
        # the module's declared factory is accepted
        reply = attacker.ask(
            SubmitJob(job=JOB.model_copy(update={"job_id": "lab"})), job__model__name=f"{name}:fine"
        )
        assert reply.ok, reply
        assert not cleared.exists(), "the coordinator ran a helper a job named"
    finally:
        attacker.close()
