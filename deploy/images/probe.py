#!/usr/bin/python3
"""Healthcheck of the worker and control images: TCP ports that accept a connection.

A coordinator or worker that listens got past its settings and keys (one that
cannot reach Redis exits, and its restart policy starts it again); a planner or
profiler is of use only while it reaches its coordinator. A connection opened
and closed at once carries no message, so ZeroMQ drops it without a log line.
Usage: asteroid-probe HOST:PORT [HOST:PORT ...]; exit 0 when every one answers.
"""

from __future__ import annotations

import socket
import sys

TIMEOUT_S = 3.0


def reachable(target: str) -> str | None:
    """None if `target` (HOST:PORT) accepts a TCP connection, else why not."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{target!r} is not HOST:PORT"
    try:
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{target}: {exc}"


def main() -> None:
    """Probe every argument; print what failed."""
    if len(sys.argv) < 2:
        print("usage: asteroid-probe HOST:PORT [HOST:PORT ...]", file=sys.stderr)
        sys.exit(2)
    failed = [why for why in map(reachable, sys.argv[1:]) if why is not None]
    for why in failed:
        print(f"asteroid-probe: {why}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
