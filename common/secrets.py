"""Masking of credentials in anything a person or a log may see.

Redis URLs carry a password (``redis://user:pass@host``) and redis-py's
errors and connection kwargs repeat it (``'password': '...'``). Every log
line, error message and status output goes through `mask` or `mask_text` on
its way out, so a credential never leaves the process except towards Redis.
Masking errs on the side of hiding: a value under a key that merely looks
secret is hidden too.

Two layers, because a password may hold any character. Patterns find
credentials by their place (a URL's userinfo, a ``password=`` value, a
``'password': ...`` item), however the password is spelt there: raw,
percent-encoded, or escaped by repr() or JSON. And the passwords this process
connects with are remembered (`remember_url`, called by the Store and the
settings) in each spelling, and hidden wherever they appear, even in free text
where no pattern can tell where a password with a space in it ends.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote

__all__ = [
    "MASK",
    "MAX_PASSWORD_BYTES",
    "MIN_REMEMBERED",
    "is_secret_key",
    "mask",
    "mask_text",
    "mask_url",
    "remember_secret",
    "remember_url",
    "url_with_password_file",
]

MASK = "***"
"""What a hidden credential is replaced with."""
MIN_REMEMBERED = 4
"""Shortest remembered secret hidden wherever it appears; a shorter one (no real
password is that short) would blank out ordinary words, so only patterns hide it."""

_SECRET_WORD = (
    r"[A-Za-z0-9_-]*(?:password|passwd|secret|token|api[_-]?key|private[_-]?key"
    r"|credentials?|authorization)[A-Za-z0-9_-]*"
)
_SECRET_KEY = re.compile(_SECRET_WORD, re.IGNORECASE)
_SCHEME = r"\b[A-Za-z][A-Za-z0-9+.-]*://"
_MAX_QUOTED = 512
"""Longest quoted URL or value read as one (a password file holds at most 512 bytes); a
longer one is masked as bare text instead. The bound keeps masking a text full of unclosed
quotes linear in its length (a log line may quote a peer)."""

# A URL inside quotes ('redis://...', "redis://...", as repr() and JSON write it) runs to
# the closing quote, escapes included, so a quote or a space in its password stays inside.
# It stops short of the next quoted URL, escaped or not: a text full of unclosed ones then
# costs a few steps per start, not a scan to the end.
_QUOTED_START = rf"['\"]{_SCHEME}"
_QUOTED_URL = re.compile(
    rf"(?P<q>['\"])(?P<url>{_SCHEME}(?:(?!{_QUOTED_START})"
    rf"(?:\\(?!{_QUOTED_START})[^\n]|(?!(?P=q))[^\\\n])){{0,{_MAX_QUOTED}}})(?P=q)",
    re.IGNORECASE,
)
# A bare URL runs to the next whitespace.
_BARE_URL = re.compile(rf"{_SCHEME}\S*", re.IGNORECASE)
_URL_START = re.compile(rf"\s*(?P<scheme>{_SCHEME})", re.IGNORECASE)
# ?password=x&db=0: the value runs to the next parameter ("&"), whatever it holds.
_QUERY_SECRET = re.compile(rf"(?P<key>(?:{_SECRET_WORD})=)[^&]*", re.IGNORECASE)
# A quoted value, escapes included (a backslash only ever starts an escape, so a value left
# open costs linear time, not exponential); whatever is glued to its closing quote (the
# tail of a value quoted twice, repr of a repr) is hidden with it.
_QUOTED_VALUE = rf"b?(?P<vq>['\"])(?:\\.|(?!(?P=vq))[^\\\n]){{0,{_MAX_QUOTED}}}(?P=vq)[^\s,}}\]]*"
# 'password': 'x', "token": "x", 'password': b'x' (Python and JSON mappings)
_QUOTED_ITEM = re.compile(
    rf"(?P<key>(?P<q>['\"])(?:{_SECRET_WORD})(?P=q)\s*:\s*)"
    rf"(?P<value>{_QUOTED_VALUE}|[^\s,}}\]]+)",
    re.IGNORECASE,
)
# password='x', password=x (kwargs reprs, env assignments): a bare value runs to the next
# whitespace, or, as a query parameter (after "?" or "&"), to the next "&"; redis-py's own
# <REDACTED> is left as it is.
_ASSIGNED = re.compile(
    rf"(?P<key>(?<![A-Za-z0-9_-])(?P<query>(?<=[?&]))?(?:{_SECRET_WORD})\s*=\s*)"
    rf"(?P<value><REDACTED>|{_QUOTED_VALUE}|(?(query)[^&\s]+|\S+))",
    re.IGNORECASE,
)

_lock = threading.Lock()
_remembered: set[str] = set()
_remembered_re: re.Pattern[str] | None = None


def is_secret_key(name: str) -> bool:
    """Whether a mapping key or keyword names a credential (password, token, secret...)."""
    return _SECRET_KEY.fullmatch(name) is not None


def _escapes(text: str) -> set[str]:
    """`text` as repr() (either quote) or JSON may write it between quotes."""
    backslashed = text.replace("\\", "\\\\")
    return {
        text,
        repr(text)[1:-1],
        backslashed,
        backslashed.replace("'", "\\'"),
        backslashed.replace('"', '\\"'),
        json.dumps(text)[1:-1],
        json.dumps(text, ensure_ascii=False)[1:-1],
    }


def _spellings(secret: str) -> set[str]:
    """How `secret` may be written out: raw, percent-encoded, escaped by repr() or JSON.

    Escaped twice too: repr(exc) of a message that itself quotes a repr.
    """
    encoded = {secret, quote(secret, safe=""), quote(secret), quote_plus(secret)}
    once = {form for text in encoded for form in _escapes(text)}
    return {form for text in once for form in _escapes(text)}


def remember_secret(secret: str) -> None:
    """Hide `secret`, in each of its spellings, wherever it appears in masked text."""
    global _remembered_re
    if len(secret) < MIN_REMEMBERED:
        return
    forms = {f for f in _spellings(secret) if len(f) >= MIN_REMEMBERED}
    with _lock:
        if forms <= _remembered:
            return
        _remembered.update(forms)
        alternatives = sorted(_remembered, key=len, reverse=True)  # longest spelling first
        _remembered_re = re.compile("|".join(re.escape(f) for f in alternatives))


def _userinfo_split(url: str) -> tuple[str, str, str] | None:
    """(scheme, userinfo, rest) of a URL, the userinfo running to its last "@"; None if none."""
    start = _URL_START.match(url)
    if start is None:
        return None
    body = url[start.end() :]
    userinfo, at, rest = body.rpartition("@")
    return (url[: start.end()], userinfo, rest) if at else (url[: start.end()], "", body)


def remember_url(url: str) -> None:
    """Remember the password (or lone token) and the query secrets of `url` (see `mask_text`)."""
    parts = _userinfo_split(url)
    if parts is None:
        return
    _, userinfo, rest = parts
    if userinfo:
        _, colon, password = userinfo.partition(":")
        secret = password if colon else userinfo
        remember_secret(secret)
        remember_secret(unquote(secret))
    _, _, query = rest.partition("?")
    for key, value in parse_qsl(query, keep_blank_values=False):
        if is_secret_key(key):
            remember_secret(value)
    for match in _QUERY_SECRET.finditer(query):
        remember_secret(match[0][len(match["key"]) :])


def _hide_remembered(text: str) -> str:
    pattern = _remembered_re
    return text if pattern is None else pattern.sub(MASK, text)


def _hide_url(url: str) -> str:
    """One URL (no surrounding text) with its userinfo password and query secrets hidden."""
    parts = _userinfo_split(url)
    if parts is None:
        return url
    scheme, userinfo, rest = parts
    if userinfo:
        user, colon, _ = userinfo.partition(":")
        # "user:pass" keeps the user, who is not secret and helps reading the error; a lone
        # userinfo may itself be a password or token (redis://PASSWORD@host), so it goes.
        userinfo = f"{user}:{MASK}@" if colon else f"{MASK}@"
    path, question, query = rest.partition("?")
    if question:
        query = _QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", query)
    return f"{scheme}{userinfo}{path}{question}{query}"


def _hide_assigned(match: re.Match[str]) -> str:
    value = match["value"]
    return match[0] if value == "<REDACTED>" else f"{match['key']}{MASK}"


def mask_url(url: str) -> str:
    """`url` with its password hidden: ``redis://user:pass@host`` -> ``redis://user:***@host``.

    The userinfo runs to the URL's last "@", so any character in a password,
    "@", "/", quotes and spaces included, is hidden with it. A password given
    as a query parameter (``?password=...``, which redis-py accepts too) is
    hidden as well. Text that is not a URL is masked as `mask_text` does.
    """
    if _URL_START.match(url) is None:
        return mask_text(url)
    return _hide_url(_hide_remembered(url))


def mask_text(text: str) -> str:
    """`text` with every URL password and every ``password=...``-like value hidden.

    Covers remembered passwords in any spelling, URLs (bare, or quoted with
    escapes as repr() and JSON write them), Python and JSON mapping reprs
    (redis-py's connection kwargs) and ``key=value`` forms, wherever they sit.
    """
    text = _hide_remembered(text)
    text = _ASSIGNED.sub(_hide_assigned, text)  # first: a value may itself look like a URL
    text = _QUOTED_URL.sub(lambda m: f"{m['q']}{_hide_url(m['url'])}{m['q']}", text)
    text = _BARE_URL.sub(lambda m: _hide_url(m[0]), text)
    return _QUOTED_ITEM.sub(lambda m: f"{m['key']}'{MASK}'", text)


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


MAX_PASSWORD_BYTES = 512
"""Longer than any generated password; a bigger file is the wrong file."""


def url_with_password_file(url: str, password_file: Path) -> str:
    """`url` (a user or none, no password) with the password read from `password_file` put in.

    So a password never sits in argv (``ps`` shows it to every local user) nor in
    a variable: the URL names the user, the file (mode 0600) holds the password.
    The password is percent-encoded into the URL and remembered for masking.
    Raises ValueError, which never quotes the file's contents.
    """
    parts = _userinfo_split(url)
    if parts is None or parts[0].lower().startswith("unix"):
        raise ValueError("a password file needs a redis:// or rediss:// URL")
    scheme, userinfo, rest = parts
    if ":" in userinfo:
        raise ValueError("the URL already holds a password; name only the user with a file")
    try:
        raw = password_file.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the password file {password_file}: {exc.strerror}") from None
    password = raw.decode("utf-8", "replace").strip("\r\n")
    if not password or len(raw) > MAX_PASSWORD_BYTES or "\n" in password or "\r" in password:
        raise ValueError(
            f"the password file {password_file} must hold one line of 1 to "
            f"{MAX_PASSWORD_BYTES} bytes"
        )
    remember_secret(password)
    joined = f"{scheme}{userinfo}:{quote(password, safe='')}@{rest}"
    remember_url(joined)
    return joined
