"""Stop strings found in streamed text: emit what is surely before any stop, end at one.

A stop string may span two pieces ("Us" then "er:"), so the last few
characters of the text are held back until it is clear they do not begin a
stop string; at a stop the text before it is emitted and the rest dropped.
"""

from __future__ import annotations

__all__ = ["StopText"]


class StopText:
    """Streamed text with OpenAI's `stop` strings cut out (they end the answer, unshown)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add `piece`; the text that can be emitted now ("" after a stop)."""
        if self.stopped:
            return ""
        self.pending += piece
        cut = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def finish(self) -> str:
        """What is still held at the end of the answer."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
