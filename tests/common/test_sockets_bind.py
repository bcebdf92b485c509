"""A bind that fails closes the socket it made: retrying a busy port leaks nothing.

`reset_router` retries its port until ZeroMQ releases it; each failed attempt
used to leave an open ROUTER behind (and, with CURVE, its ZAP handler's hold
on the context), which kept `Context.term()` waiting forever.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import zmq

from common.codec import Limits
from common.sockets import bind_router


def test_a_failed_bind_leaves_no_socket_open() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with pytest.raises(zmq.ZMQError):
                    bind_router(ctx, endpoint, Limits())
            gc.collect()
        leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert leaked == [], [str(w.message) for w in leaked]
    finally:
        sock.close(0)
        ctx.term()  # returns only once every socket of the context is closed
