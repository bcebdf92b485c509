"""A serving spec names a model folder; the shape comes from the folder's config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from common.errors import ConfigError
from common.serving_messages import ServeSpec
from services.cli.serve import load_serve_spec
from services.lib.galaxy import pretrained
from tests.galaxy import hf_folders

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_folders.save(hf_folders.gpt2(), tmp_path_factory.mktemp("specs") / "gpt2")


def _spec_file(where: Path, **fields: object) -> Path:
    file = where / "serve.yaml"
    file.write_text(yaml.safe_dump({"serve_id": "mine", "source": "pretrained", **fields}))
    return file


def test_a_spec_file_naming_a_folder_gets_its_shape_and_an_absolute_path(folder, tmp_path):
    spec = load_serve_spec(_spec_file(folder.parent, path="gpt2"))  # relative to the file
    assert spec.path == str(folder.resolve())
    assert spec.model == pretrained.read_shape(folder)
    spec = load_serve_spec(_spec_file(tmp_path, path=str(folder), model=spec.model.model_dump()))
    assert spec.model == pretrained.read_shape(folder)  # a matching shape is kept


def test_a_shape_that_is_not_the_folders_is_refused_naming_the_fields(folder, tmp_path):
    shape = pretrained.read_shape(folder).model_dump()
    file = _spec_file(tmp_path, path=str(folder), model={**shape, "layers": 3})
    with pytest.raises(ConfigError, match=r"serve\.yaml: model \{'layers': 3\} differs from"):
        load_serve_spec(file)


def test_a_folder_only_on_the_devices_needs_the_shape_in_the_spec(folder, tmp_path):
    shape = pretrained.read_shape(folder).model_dump()
    spec = load_serve_spec(_spec_file(tmp_path, path="/on/the/devices", model=shape))
    assert spec.path == "/on/the/devices" and spec.model is not None
    with pytest.raises(ConfigError, match="'/on/the/devices' is not a directory"):
        load_serve_spec(_spec_file(tmp_path, path="/on/the/devices"))


def test_a_folder_we_cannot_serve_is_refused_when_the_spec_is_read(folder, tmp_path):
    with pytest.raises(ConfigError, match=r"serve\.yaml: model folder .* has no config\.json"):
        load_serve_spec(_spec_file(tmp_path, path="."))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"source": "pretrained"}, "needs `path`"),
        ({"source": "pretrained", "path": "/m"}, "needs `model`"),
        ({"source": "init", "path": "/m"}, "`path` is for source pretrained, not init"),
        ({"source": "pretrained", "path": "relative/m"}, "should match pattern"),
        ({"source": "pretrained", "path": "/m\x00"}, "should match pattern"),
        ({"source": "pretrained", "path": "/" + "m" * 5000}, "at most 4096 characters"),
    ],
)
def test_a_pretrained_spec_on_the_wire_names_an_absolute_folder(fields, error):
    with pytest.raises(ValidationError, match=error):
        ServeSpec(serve_id="mine", **fields)
