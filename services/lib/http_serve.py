"""One HTTP app served by uvicorn until the service's stop: the gateway's and the dashboard's.

uvicorn runs on a thread of its own, where it leaves the signals alone, so the
stop (`common.bootstrap.Stop`: SIGTERM, Ctrl-C) stays the main thread's and
ends the server cleanly: requests in flight get `grace_s` to finish, then the
server closes. uvicorn's own answer to an address it cannot bind is a
SystemExit on its thread (after logging why); here it is one ConfigError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from common.bootstrap import Stop
from common.errors import ConfigError

__all__ = ["serve_http"]

POLL_S = 0.2
"""How often the main thread looks at the HTTP server's thread."""


def _bound_port(server: Any, fallback: int) -> int:
    """The port uvicorn listens on (the one the system chose for port 0)."""
    for srv in getattr(server, "servers", []) or []:
        for sock in getattr(srv, "sockets", []) or []:
            return int(sock.getsockname()[1])
    return fallback


def _run(server: Any) -> None:
    """Run uvicorn's server; its exit when it cannot listen is reported by the main thread."""
    try:
        server.run()
    except SystemExit:
        return


def serve_http(
    app: Any,
    host: str,
    port: int,
    stop: Stop,
    grace_s: int,
    what: str,
    on_listening: Callable[[str], None],
) -> None:
    """Serve `app` on `host:port` until `stop`; `on_listening(url)` once it listens.

    Raises:
        ConfigError: `what` could not listen there (the port taken, or not an
            address of this machine).

    """
    import uvicorn  # the callers' extra (gateway, dashboard) brings it

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(grace_s),
    )
    server = uvicorn.Server(config)
    stop.on_stop(lambda _signal: setattr(server, "should_exit", True))
    thread = threading.Thread(target=_run, args=(server,), name="http", daemon=True)
    thread.start()
    url = None
    try:
        while thread.is_alive():
            thread.join(POLL_S)
            if server.started and url is None:
                shown = f"[{host}]" if ":" in host else host
                url = f"http://{shown}:{_bound_port(server, port)}/"
                on_listening(url)
    finally:
        server.should_exit = True
        thread.join(grace_s)
    if url is None:
        raise ConfigError(
            f"{what} could not listen on {host}:{port} (taken, or not an address of this machine?)"
        )
