"""The configuration reference table, generated from the settings models.

The README embeds this table between markers; a test keeps the two in sync so
documentation cannot drift from the code.
"""

from __future__ import annotations

from pydantic_settings import BaseSettings

from common.settings import CommonSettings, CoordinatorSettings, WorkerSettings

__all__ = ["settings_table"]


def _rows(cls: type[BaseSettings], skip: set[str], who: str) -> list[str]:
    out = []
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        default = "" if field.default is None else field.default
        out.append(
            f"| `ASTEROID_{name.upper()}` | `--{name.replace('_', '-')}` | {who} | "
            f"`{default}` | {field.description} |"
        )
    return out


def settings_table() -> str:
    """Markdown table of every setting: variable, flag, service, default, meaning."""
    common = set(CommonSettings.model_fields)
    lines = [
        "| variable | flag | service | default | meaning |",
        "|---|---|---|---|---|",
        *_rows(CommonSettings, set(), "all"),
        *_rows(WorkerSettings, common, "worker"),
        *_rows(CoordinatorSettings, common, "coordinator"),
    ]
    return "\n".join(lines)
