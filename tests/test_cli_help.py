"""Help a person can read and follow: no type noise, no dead advice, every model, did-you-mean.

Each test is a friction a newcomer met: services' `--help` showing `{Path,null}`
and `tuple[str,...]`, the coordinator offering `--coordinator`, the settings
table showing `PydanticUndefined`, `asteroid serve` suggesting a command that
fails, `fl_cnn` missing from the model lists, and a typo'd key hidden behind
the error it causes, with no suggestion.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from common.config_docs import job_table, settings_table
from common.errors import ConfigError
from common.messages import JobReply
from common.settings import CoordinatorSettings, ProfilerSettings
from common.zoo import ModelSpec, model_names
from services.cli import app
from services.cli import main as asteroid_main
from tests.test_cli_flags import MAINS, run_main

ROOT = Path(__file__).resolve().parent.parent
NOISE = ("{Path,null}", "{str,null}", "tuple[", "list[", "PydanticUndefined", "(default: null)")


def service_help(service: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert run_main(service, ["--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("service", sorted(MAINS))
def test_a_services_help_shows_no_python_types(
    service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = service_help(service, capsys)
    assert not [n for n in NOISE if n in text], text
    assert "--version" in text


def test_the_coordinator_does_not_offer_a_coordinator_address(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for service in ("coordinator", "federation"):  # each binds --bind; none dials a coordinator
        text = service_help(service, capsys)
        assert "--coordinator" not in text
        assert "--bind" in text
    assert "--coordinator" in service_help("worker", capsys)  # a worker does need it


def test_byte_counts_and_lists_say_what_they_take(capsys: pytest.CaptureFixture[str]) -> None:
    text = service_help("worker", capsys)
    assert "--memory-budget BYTES" in text
    assert "--model-modules A,B,..." in text
    assert "--keys PATH" in text


def test_the_settings_table_shows_every_default_as_a_value() -> None:
    table = settings_table()
    assert "PydanticUndefined" not in table
    assert "``" not in table  # an empty code span
    batch_sizes = next(r for r in table.splitlines() if "ASTEROID_BATCH_SIZES" in r)
    assert "| empty |" in batch_sizes
    spec = next(r for r in table.splitlines() if "ASTEROID_SPEC" in r)
    assert "| required |" in spec


@pytest.mark.parametrize("model", model_names())
def test_every_zoo_model_is_in_the_model_lists(model: str) -> None:
    assert model in (ModelSpec.model_fields["name"].description or "")
    assert model in (ProfilerSettings.model_fields["model"].description or "")
    assert model in job_table()


def _commands_in(text: str) -> list[list[str]]:
    return [c.split()[1:] for c in re.findall(r"`(asteroid [^`]+)`", text)]


def test_serve_suggests_commands_that_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import services.cli.client as client

    def accepted(address: str, msg: Any, timeout_s: float = 15.0) -> JobReply:
        return JobReply(job_id=msg.spec.serve_id, ok=True)

    monkeypatch.setattr(client, "ask_coordinator", accepted)
    monkeypatch.setenv("COLUMNS", "300")
    spec = ROOT / "services/cli/examples/serve-gpt2.yaml"
    with pytest.raises(SystemExit) as done:
        asteroid_main(["serve", str(spec), "--coordinator", "tcp://127.0.0.1:1"])
    assert done.value.code == 0
    suggested = _commands_in(capsys.readouterr().out)
    assert len(suggested) >= 2, suggested
    group: Any = typer.main.get_command(app)
    for argv in suggested:  # each parses: the command exists and takes these arguments
        ctx = group.make_context("asteroid", ["--version"], resilient_parsing=True)
        cmd = group.get_command(ctx, argv[0])
        assert cmd is not None, argv
        cmd.make_context(argv[0], argv[1:], parent=ctx)  # a bad argument raises


def test_an_unknown_command_gets_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        asteroid_main(["stauts"])
    assert done.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["asteroid: error: No such command 'stauts'. Did you mean 'status'?"]


def _job_error(tmp_path: Path, text: str) -> str:
    from common.job import load_job

    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_job(path)
    return str(err.value).removeprefix(f"job {path}: ")


JOB = (ROOT / "services/cli/examples/job-demo.yaml").read_text()


@pytest.mark.parametrize(
    ("typo", "says"),
    [
        # a required key misspelt: its "required but missing" came first, the cause hidden
        (("model:", "modle:"), "modle: unknown key (did you mean 'model'?) (and 1 more)"),
        (("eval_every:", "eval_evry:"), "eval_evry: unknown key (did you mean 'eval_every'?)"),
        (
            ("warmup_rounds:", "warmup_roundz:"),
            "optimizer.schedule.warmup_roundz: unknown key (did you mean 'warmup_rounds'?)",
        ),
    ],
)
def test_a_typod_job_key_is_named_first_with_the_closest(
    tmp_path: Path, typo: tuple[str, str], says: str
) -> None:
    assert _job_error(tmp_path, JOB.replace(*typo)) == says


def test_a_typod_serving_spec_key_gets_the_closest(tmp_path: Path) -> None:
    from services.cli.serve import load_serve_spec

    text = (ROOT / "services/cli/examples/serve-gpt2.yaml").read_text()
    path = tmp_path / "serve.yaml"
    path.write_text(text.replace("seq_len:", "seq_lenn:"))
    with pytest.raises(ConfigError, match=r"seq_lenn: unknown key \(did you mean 'seq_len'\?\)"):
        load_serve_spec(path)


def test_a_typod_federation_spec_key_gets_the_closest(tmp_path: Path) -> None:
    from common.fl.spec import load_federation

    text = (ROOT / "services/cli/examples/federation-digits.yaml").read_text()
    key = re.findall(r"^([a-z_]+):", text, re.M)[0]
    path = tmp_path / "fl.yaml"
    path.write_text(text.replace(f"{key}:", f"{key}x:", 1))
    with pytest.raises(ConfigError, match=rf"{key}x: unknown key \(did you mean '{key}'\?\)"):
        load_federation(path)


def test_a_hidden_setting_is_still_accepted() -> None:
    """The same ASTEROID_* environment serves every service: the coordinator's is not an error."""
    from common.cli_args import parse_settings

    s = parse_settings(CoordinatorSettings, ["--coordinator", "tcp://10.0.0.1:5555"], "c")
    assert s.coordinator == "tcp://10.0.0.1:5555"


def test_a_typod_cluster_file_key_gets_the_closest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (ROOT / "services/cli/examples/cluster.yaml").read_text()
    path = tmp_path / "cluster.yaml"
    path.write_text(text.replace("memory_bytes", "memory_byte"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    args = ["plan", "--cluster", str(path), "--global-batch", "8", "--microbatches", "2"]
    with pytest.raises(SystemExit) as done:
        asteroid_main(args)
    assert done.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "devices.0.memory_byte: unknown key (did you mean 'memory_bytes'?)" in line
