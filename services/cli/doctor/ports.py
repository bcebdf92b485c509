"""Whether the ports this device's worker binds (data plane, link sink) are free.

Bound the way ZeroMQ binds them (SO_REUSEADDR, so a port in TIME_WAIT after
a worker stopped reads free, as it is to ZeroMQ), on the interface the worker
would use, and closed at once.
"""

from __future__ import annotations

import errno
import socket

from services.cli.doctor.report import Check

__all__ = ["port_check"]


def port_check(what: str, flag: str, host: str, port: int) -> Check:
    """The row of one port the worker binds: `what` (``data port``) set by `flag`."""
    data = {"host": host, "port": port}
    if port == 0:
        return Check(what, "ok", f"{host}: any free port (0)", data=data)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return Check(
                    what,
                    "problem",
                    f"{host}:{port} is taken (a worker already running here holds it too)",
                    f"ss -ltnp 'sport = :{port}' shows who; stop it, or give the worker {flag} N",
                    {**data, "free": False},
                )
            return Check(
                what,
                "problem",
                f"cannot bind {host}:{port}: {exc.strerror}",
                f"give the worker {flag} N (above 1023), or --data-host an address of this device",
                {**data, "free": False},
            )
    return Check(what, "ok", f"{host}:{port} is free", data={**data, "free": True})
