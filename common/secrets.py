"""Masking of credentials in anything a person or a log may see.

Redis URLs carry a password (``redis://user:pass@host``) and redis-py's
errors and connection kwargs repeat it (``'password': '...'``). Every log
line, error message and status output goes through `mask` or `mask_text` on
its way out, so a credential never leaves the process except towards Redis.
Masking errs on the side of hiding: a value under a key that merely looks
secret is hidden too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "is_secret_key", "mask", "mask_text", "mask_url"]

MASK = "***"
"""What a hidden credential is replaced with."""

_SECRET_WORD = (
    r"[A-Za-z0-9_-]*(?:password|passwd|secret|token|api[_-]?key|private[_-]?key"
    r"|credentials?|authorization)[A-Za-z0-9_-]*"
)
_SECRET_KEY = re.compile(_SECRET_WORD, re.IGNORECASE)

# scheme://userinfo@ : the userinfo runs to the last "@" before the host, so a raw
# "@" inside a password is hidden with the rest of it.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/'\"<>]*)@")
# 'password': 'x', "token": "x", 'password': b'x' (Python and JSON mappings)
_QUOTED_ITEM = re.compile(
    rf"(?P<key>(?P<q>['\"])(?:{_SECRET_WORD})(?P=q)\s*:\s*)"
    r"(?P<value>b?(?P<vq>['\"])(?:\\.|(?!(?P=vq)).)*(?P=vq)|[^\s,}\]]+)",
    re.IGNORECASE,
)
# password='x', password=x (kwargs reprs, query strings, env assignments)
_ASSIGNED = re.compile(
    rf"(?P<key>\b(?:{_SECRET_WORD})\s*=\s*)"
    r"(?P<value>b?(?P<vq>['\"])(?:\\.|(?!(?P=vq)).)*(?P=vq)|[^\s,&;)>\]}]+)",
    re.IGNORECASE,
)


def is_secret_key(name: str) -> bool:
    """Whether a mapping key or keyword names a credential (password, token, secret...)."""
    return _SECRET_KEY.fullmatch(name) is not None


def _hide_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    # "user:pass" keeps the user, who is not secret and helps reading the error; a lone
    # userinfo may itself be a password or token (redis://PASSWORD@host), so it goes.
    return f"{match['scheme']}{user}:{MASK}@" if colon else f"{match['scheme']}{MASK}@"


def _hide_assigned(match: re.Match[str]) -> str:
    return f"{match['key']}{MASK}"


def mask_url(url: str) -> str:
    """`url` with its password hidden: ``redis://user:pass@host`` -> ``redis://user:***@host``.

    A password given as a query parameter (``?password=...``, which redis-py
    accepts too) is hidden as well.
    """
    return _ASSIGNED.sub(_hide_assigned, _URL_USERINFO.sub(_hide_userinfo, url))


def mask_text(text: str) -> str:
    """`text` with every URL password and every ``password=...``-like value hidden.

    Covers URLs, Python and JSON mapping reprs (redis-py's connection kwargs)
    and ``key=value`` forms, wherever they sit in the text.
    """
    return _QUOTED_ITEM.sub(lambda m: f"{m['key']}'{MASK}'", mask_url(text))


def mask(value: Any) -> Any:
    """`value` with credentials hidden, for logging or showing it.

    Strings are masked as text; mappings lose the values of secret-looking keys
    (and their other values are masked in turn); lists, tuples and sets are
    masked item by item; an exception becomes its masked message. Any other
    object is returned as is unless its repr would show a credential, in which
    case the masked repr replaces it.
    """
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, bytes | bytearray):
        masked = mask_text(bytes(value).decode("utf-8", "replace"))
        return value if masked == bytes(value).decode("utf-8", "replace") else masked
    if isinstance(value, Mapping):
        return {
            k: (MASK if isinstance(k, str) and is_secret_key(k) and v else mask(v))
            for k, v in value.items()
        }
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(mask(v) for v in value)
    if isinstance(value, BaseException):
        text = str(value)
        masked = mask_text(text)
        return value if masked == text else f"{type(value).__name__}: {masked}"
    text = repr(value)
    masked = mask_text(text)
    return value if masked == text else masked
