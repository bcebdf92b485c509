"""The base of every wire message: frozen, and strict about unknown fields.

Its own module so that message families kept apart (training in
`common.messages`, serving in `common.serving_messages`) share it without a
circular import; `common.messages` joins them into the one union the codec decodes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["WireModel"]


class WireModel(BaseModel):
    """A message or a part of one: immutable once decoded, no field beyond its schema."""

    model_config = ConfigDict(frozen=True, extra="forbid")
