"""Services start by their installed commands, found beside the running interpreter."""

import sys
import sysconfig
from pathlib import Path

import pytest

from common.entry_points import SERVICE_SCRIPTS, service_command
from common.errors import ConfigError


@pytest.mark.parametrize("service", sorted(SERVICE_SCRIPTS))
def test_a_service_runs_as_its_script_under_this_interpreter(service):
    python, script = service_command(service)
    assert python == sys.executable
    assert Path(script).name == f"asteroid-{service}"
    assert Path(script).is_file()


def test_an_unknown_service_is_named():
    with pytest.raises(ConfigError, match="no service 'nonesuch'; one of coordinator"):
        service_command("nonesuch")


def test_a_missing_script_says_where_it_looked_and_what_to_install(tmp_path, monkeypatch):
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setattr(sys, "executable", str(bare / "python3"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path / "scripts"))
    with pytest.raises(ConfigError) as err:
        service_command("worker")
    message = str(err.value)
    assert "asteroid-worker is not installed in this environment" in message
    assert str(bare) in message and str(tmp_path / "scripts") in message
    assert "pip install asteroid-edge" in message
