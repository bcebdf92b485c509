"""`asteroid-profiler --serve` as a real process: it announces itself, answers over
ZeroMQ, profiles into Redis, and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

import pytest
import zmq

from common.codec import Limits, peer_of_route, recv_message, send_message
from common.device import device_fingerprint
from common.messages import ProfileReply, ProfileRequest, ServiceHello
from common.profile import Profile
from common.sockets import bind_router, poll_in
from common.store import Store
from common.zoo import ModelSpec
from tests.cluster import LocalCluster

pytestmark = pytest.mark.integration


def _next(router: zmq.Socket[Any], kind: type, timeout_s: float) -> tuple[bytes, Any]:
    """(route, message) of the next message of `kind`; anything else is skipped."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and poll_in(router, left):
        _, env = recv_message(router, Limits(), routed=True)
        if isinstance(env.msg, kind):
            return env.route, env.msg
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


def test_profiler_service_answers_and_stops_on_sigterm(tmp_path, redis_url, cluster_name):
    local = LocalCluster(tmp_path, redis_url, cluster_name)
    ctx: zmq.Context[Any] = zmq.Context()
    router, _ = bind_router(ctx, local.addr, Limits())
    store = Store(redis_url, cluster_name)
    proc = local.spawn(
        "profiler",
        ["-m", "services.profiler.main", "--serve", "--repeats", "1", "--warmup", "0"],
    )
    try:
        route, hello = _next(router, ServiceHello, 60)
        assert hello.pid == proc.pid and hello.service == peer_of_route(route)
        fp = device_fingerprint(1)  # the child runs on this machine, with the same limits
        req = ProfileRequest(
            job_id="j1", model=ModelSpec(name="mlp"), fingerprint=fp, threads=1, batch_sizes=[1]
        )
        send_message(router, req, "coordinator", route=route)
        _, reply = _next(router, ProfileReply, 120)
        assert reply.ok, f"{reply.error}\n{local.log('profiler')}"
        assert Profile.model_validate(store.get_json("profile", reply.key)).device == fp

        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"no exit within 10 s of SIGTERM:\n{local.log('profiler')}"
            ) from None
        assert code == 0, local.log("profiler")
    finally:
        local.close()
        store.close()
        router.close(0)
        ctx.term()
