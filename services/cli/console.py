"""What the CLI prints: credentials hidden and no peer able to drive the terminal.

Device names, job ids, errors and model names shown by `asteroid status` and
the other commands come from peers (a heartbeat, a worker's error text, Redis).
Printed raw, an ESC sequence in a device name clears or rewrites the operator's
screen and a bidi override reorders what they read. Every console of the CLI is
a `CliConsole`, which makes each string visible (`visible`) before rich renders
it; a peer's string put inside the CLI's own markup goes through `shown`, which
also keeps it from being read as markup or from breaking a row into two lines.
"""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from common.secrets import mask_text

__all__ = ["CliConsole", "shown", "visible"]

_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
# C0 controls but newline and tab, DEL, C1 controls (CSI is U+009B), bidi overrides and
# isolates, the line and paragraph separators
_UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}\u2028\u2029]")
_UNSAFE_IN_LINE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}\u2028\u2029]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    r"""`text` with credentials hidden and every control character written as an escape.

    Newlines and tabs stay (the CLI's own tables and messages use them); ESC,
    the other C0 and C1 controls, DEL and bidi controls become ``\x1b``-like text.
    """
    return _UNSAFE.sub(_escaped, mask_text(text))


def shown(value: object) -> str:
    """A peer-supplied `value` ready to sit in the CLI's markup: one line, inert, masked."""
    return escape(_UNSAFE_IN_LINE.sub(_escaped, mask_text(str(value))))


class CliConsole(Console):
    """A rich Console whose every string passes `visible` before markup is read."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        """Render `text` as rich does, after `visible` (tables, print and log all come here)."""
        return super().render_str(visible(text), **kwargs)
