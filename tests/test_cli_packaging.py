"""The examples ship inside the package, and the CLI names what it does not import."""

import pytest
import yaml
from typer.testing import CliRunner

from common.errors import ConfigError
from common.exit_codes import ExitCode
from common.fl.spec import load_federation
from common.job import load_job
from common.plan import Plan
from common.profile import ClusterSpec
from services.cli import app
from services.cli.example_files import DEMO_JOB, example_names, example_path
from services.cli.serve import load_serve_spec
from services.cli.testbed import PRESET_NAMES, _short
from services.testbed.spec import PRESETS


def test_the_examples_are_package_data_that_load():
    names = example_names()
    assert {DEMO_JOB, "job-small-cnn.yaml", "plan-hybrid-5.json", "serve-gpt2.yaml"} <= set(names)
    for name in names:
        with example_path(name) as path:
            if name == "serve-pretrained.yaml":  # names a person's model folder: none here
                with pytest.raises(ConfigError, match="is not a directory"):
                    load_serve_spec(path)
            elif name.startswith("serve-"):
                assert load_serve_spec(path).serve_id
            elif name.startswith("federation-"):
                assert load_federation(path).homes
            elif name.startswith("cluster"):  # for asteroid plan
                assert ClusterSpec.model_validate(yaml.safe_load(path.read_text())).devices
            elif name.endswith(".yaml"):
                assert load_job(path).job_id
            else:
                assert Plan.model_validate_json(path.read_text()).stages


def test_an_unknown_example_lists_the_shipped_ones():
    says = f"no example 'nope.yaml'; shipped: .*{DEMO_JOB}"
    with pytest.raises(FileNotFoundError, match=says), example_path("nope.yaml"):
        pass


def test_asteroid_examples_writes_them_and_keeps_edits_unless_forced(tmp_path):
    out = tmp_path / "mine"
    res = CliRunner().invoke(app, ["examples", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == example_names()
    job = out / DEMO_JOB
    with example_path(DEMO_JOB) as shipped:
        assert job.read_bytes() == shipped.read_bytes()
    job.write_text(yaml.safe_dump({"job_id": "edited"}))
    again = CliRunner().invoke(app, ["examples", str(out)])
    assert again.exit_code == ExitCode.CONFIG
    assert "already has" in again.output and "--force" in again.output
    assert "edited" in job.read_text()
    forced = CliRunner().invoke(app, ["examples", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert "edited" not in job.read_text()


def test_the_testbed_help_names_every_preset():
    assert tuple(PRESETS) == PRESET_NAMES


@pytest.mark.parametrize(
    ("process", "short"),
    [
        ("41 /venv/bin/python3 /venv/bin/asteroid-worker --device a", "41 worker"),
        ("42 /usr/bin/python3 -m services.profiler.main --serve", "42 profiler"),
        ("43 /usr/bin/sleep 60", "43 sleep 60"),
    ],
)
def test_testbed_status_names_services_by_their_command(process, short):
    assert _short(process) == short
