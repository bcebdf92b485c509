"""The base of every record model: what older or newer writers add still loads."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["RecordModel", "known_fields"]


class RecordModel(BaseModel):
    """A record read back from Redis: frozen, and tolerant of fields it does not name.

    Records outlive the release that wrote them (a job's hash stays for weeks),
    so a field an older coordinator wrote, or a newer one adds, is kept as an
    extra rather than making the whole record unreadable.
    """

    model_config = ConfigDict(frozen=True, extra="allow")

    def fields(self) -> dict[str, Any]:
        """The fields the record holds, as written (extras included, defaults left out)."""
        return self.model_dump(exclude_unset=True)


def known_fields(model: type[RecordModel], fields: dict[str, Any], what: str) -> dict[str, Any]:
    """`fields`, after checking each is one `model` names and has its type.

    A writer may only write what the record's model declares: a misspelt field
    would otherwise be stored and never read. Raises ValueError naming the
    unknown fields, or pydantic's ValidationError naming a mistyped one.
    """
    unknown = sorted(set(fields) - set(model.model_fields))
    if unknown:
        raise ValueError(f"{what} has no field {', '.join(unknown)}")
    model.model_validate(fields)
    return fields
