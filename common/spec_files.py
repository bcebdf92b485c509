"""Reading a spec file (YAML or JSON) into its pydantic model, with one error line.

Job specs, serving specs and testbed files are all read this way, so every
one of them fails alike: the file and the offending field named, never a
traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from common.errors import ConfigError, validation_message

__all__ = ["load_spec_file"]

M = TypeVar("M", bound=BaseModel)


def load_spec_file(
    path: Path,
    model: type[M],
    what: str,
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> M:
    """`model` read from YAML (or JSON) file `path`; `what` names it in errors ("job").

    `prepare` may complete the fields before they are validated (a serving
    spec's model shape read from the folder it names); its ConfigError names the file.

    Raises:
        ConfigError: The file cannot be read or parsed, is not a mapping, or a
            field is invalid (named).

    """
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of fields, got {type(data).__name__}")
    if prepare is not None:
        try:
            data = prepare(data)
        except ConfigError as exc:
            raise ConfigError(f"{what} {path}: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{what} {path}: {validation_message(exc, model=model)}") from exc
