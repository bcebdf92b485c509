"""Sizes and rates as people type them in flags and `ASTEROID_*` variables.

A byte size takes a unit (`2GB` is 10^9-based, `512MiB` 2^30-based, a bare
number is bytes), parsed by pydantic's `ByteSize`. A bandwidth has exactly
one unit, bytes per second: a bare number, or a number with `B/s` and an
optional prefix (`125MB/s`). Bits (`1gbit`, `100Mbps`, `100Mb/s`) and a bare
prefix (`125M`) are refused by name rather than guessed, since a factor of
eight between the planner's link and the real one silently skews every plan.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, ByteSize, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

__all__ = ["Bytes", "BytesPerSecond", "parse_bytes", "parse_bytes_per_s"]

_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
_SIZE = re.compile(r"^\s*(?:[0-9]+\.?[0-9]*|\.[0-9]+)\s*[A-Za-z]*\s*$")
_SIZE_HINT = "expected bytes: a whole number or one with a unit, like 1073741824, 2GB or 512MiB"


def parse_bytes(value: Any) -> Any:
    """Bytes from text through pydantic's `ByteSize`, with one message showing the forms.

    Numbers pass through for the field's own checks (`ge`, `gt`), which already
    say what was wanted.
    """
    if not isinstance(value, str):
        return value
    try:
        if not _SIZE.match(value):  # ByteSize alone would read "2 GB please" as 2 GB
            raise ValueError(value)
        return int(_BYTE_SIZE.validate_python(value))
    except (ValueError, ValidationError):
        raise PydanticCustomError("byte_size", _SIZE_HINT) from None


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
"""A byte count given as `1073741824`, `2GB` (powers of 1000) or `512MiB` (powers of 1024)."""

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(
    r"^\s*(?P<number>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"\s*(?:(?P<prefix>[kKmMgGtT]?)(?P<binary>i?)B/s)?\s*$"
)
_BITS = re.compile(r"(?i:bits?|bps)$|b/s$")  # a lower-case b is a bit
_RATE_HINT = "bandwidths are bytes per second: a number or one like 125MB/s (125e6 is 1 Gbit/s)"


def parse_bytes_per_s(value: Any) -> Any:
    """Bytes per second from `125e6`, `125000000`, `125MB/s` or `119.2MiB/s`.

    Numbers pass through for the field's own checks; text in bits or without
    the `B/s` after a prefix is refused with an error saying which unit is wanted.
    """
    if not isinstance(value, str):
        return value
    m = _RATE.match(value)
    if m is None:
        if _BITS.search(value.strip()):
            raise PydanticCustomError("bandwidth", f"that is bits per second; {_RATE_HINT}")
        raise PydanticCustomError("bandwidth", _RATE_HINT)
    prefix = (m["prefix"] or "").lower()
    scale = 1024.0 ** list(_PREFIX).index(prefix) if m["binary"] else _PREFIX[prefix]
    return float(m["number"]) * scale


BytesPerSecond = Annotated[float, BeforeValidator(parse_bytes_per_s)]
"""A bandwidth in bytes per second: `125e6` or `125MB/s`; bits are refused."""
