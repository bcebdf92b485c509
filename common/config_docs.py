"""The configuration and job-spec reference tables, generated from their models.

`docs/configuration.md` embeds these tables between markers (`DOC`); a test keeps
them in sync so documentation cannot drift from the code. Regenerate with
`python -m common.config_docs [FILE]`.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from common.fl.spec import FederationSpec
from common.job import JobSpec
from common.settings import (
    CommonSettings,
    CoordinatorSettings,
    FederationSettings,
    ProfilerSettings,
    WorkerSettings,
)

__all__ = [
    "DOC",
    "SECTIONS",
    "federation_table",
    "job_table",
    "render",
    "setting_default",
    "settings_table",
]

DOC = "docs/configuration.md"
"""The page holding every generated table (relative to the repository root): one file, so
the three tables are regenerated together and the README stays a screen long."""


def _rows(cls: type[BaseSettings], skip: set[str], who: str) -> list[str]:
    out = []
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        out.append(
            f"| `ASTEROID_{name.upper()}` | `--{name.replace('_', '-')}` | {who} | "
            f"{setting_default(field)} | {field.description} |"
        )
    return out


def setting_default(field: FieldInfo) -> str:
    """A setting's default as the table shows it: never `PydanticUndefined` or an empty span.

    A default_factory's value is computed (it has no `default`); unset and empty
    values are said in words, since an empty code span renders as two backticks.
    """
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value in ("", (), []):
        return "empty"
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    return f"`{value}`"


def settings_table() -> str:
    """Markdown table of every setting: variable, flag, service, default, meaning."""
    common = set(CommonSettings.model_fields)
    lines = [
        "| variable | flag | service | default | meaning |",
        "|---|---|---|---|---|",
        *_rows(CommonSettings, set(), "all"),
        *_rows(WorkerSettings, common, "worker"),
        *_rows(CoordinatorSettings, common, "coordinator"),
        *_rows(ProfilerSettings, common, "profiler"),
        *_rows(FederationSettings, common, "federation"),
    ]
    return "\n".join(lines)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (through unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return "`null`" if value is None else f"`{value}`"


def _job_rows(model: type[BaseModel], prefix: str) -> list[str]:
    out = []
    # a union member's tag first, even where its shared fields come from a base class
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] != "kind")
    for name, field in fields:
        path, meaning = f"{prefix}{name}", field.description or ""
        kinds = typing.get_args(field.annotation) if name == "kind" else ()
        if len(kinds) == 1:  # the tag of one member of a union: the rows below are its own
            path, meaning = f"{prefix}kind: {kinds[0]}", "the keys below belong to this kind"
        out.append(f"| `{path}` | {_default(field)} | {meaning} |")
        for sub in _models(field.annotation):
            out += _job_rows(sub, f"{path}.")
    return out


def job_table() -> str:
    """Markdown table of every job-spec key: dotted path, default, meaning."""
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *_job_rows(JobSpec, "")])


def federation_table() -> str:
    """Markdown table of every federation-spec key (`asteroid-federation --spec`)."""
    rows = _job_rows(FederationSpec, "")
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *rows])


SECTIONS = {"settings": settings_table, "job": job_table, "federation": federation_table}
"""Sections of `DOC` generated here, between `<!-- NAME:begin -->` and `<!-- NAME:end -->`."""


def render(text: str) -> str:
    """`text` with every generated section replaced by its current table."""
    for name, make in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


if __name__ == "__main__":
    import sys
    from pathlib import Path

    page = Path(sys.argv[1] if len(sys.argv) > 1 else DOC)
    page.write_text(render(page.read_text()))
