"""The installed Asteroid-Edge release, read from the package's metadata.

One place answers "which version is this?" for `--version`, heartbeats and
images, so a device running an older release is named, not guessed at.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["VERSION"]

_DIST = "asteroid-edge"


def _installed() -> str:
    try:
        return version(_DIST)
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


VERSION = _installed()
"""This release's version string (PEP 440), "0+unknown" when not installed."""
