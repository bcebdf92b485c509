"""`asteroid-planner`: turns profiles in Redis into plans on request.

The planner is a DEALER on the coordinator's control plane (identity
"planner"), like every service: it announces itself periodically, answers
each PlanRequest with a PlanReply that carries the plan; the coordinator
records the plan a job runs on.

Exit codes (`common.exit_codes.ExitCode`): 0 stopped by SIGTERM/SIGINT, 2
invalid settings, such as a `--keys` directory without this service's key or
the coordinator's public key.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import zmq

from common.bootstrap import Stop, run_service
from common.codec import Limits, encode, recv_message
from common.curve import service_keys
from common.errors import AsteroidError, ConfigError, ProtocolError
from common.exit_codes import ExitCode
from common.logging import get_logger
from common.messages import PlanReply, PlanRequest, ServiceHello
from common.plan import Plan
from common.profile import load_profiles
from common.settings import CommonSettings
from common.sockets import connect_dealer
from common.store import Store
from services.planner.cost import CostModel
from services.planner.registry import get_planner
from services.planner.simulator import estimate

__all__ = ["IDENTITY", "PlannerService", "main", "make_plan", "run"]

log = get_logger(__name__)
IDENTITY = "planner"


def make_plan(store: Store, req: PlanRequest) -> tuple[Plan, float]:
    """Plan `req` with the named planner (its profiles read from Redis).

    Also the predicted round of `req.current` on the same cluster (0 without
    one, or if it does not fit the cluster): a re-plan compares the two by the
    same cost model.
    """
    cost = CostModel(
        load_profiles(store, req.profiles), req.cluster, req.mode, req.aggregate_every > 0
    )
    plan = get_planner(req.planner).plan(cost, req.global_batch, req.microbatches)
    current_s = 0.0
    if req.current is not None:
        try:
            current_s = estimate(req.current, cost)
        except AsteroidError as exc:
            log.warning("cannot predict the running plan", job=req.job_id, error=str(exc))
    return plan, current_s


class PlannerService:
    """The planner's control-plane loop."""

    def __init__(self, settings: CommonSettings) -> None:
        """Connect to the coordinator.

        Raises:
            ConfigError: `--keys` lacks a key this service needs.
            zmq.ZMQError: The coordinator's address is invalid.

        """
        self.settings = settings
        self.limits = Limits(settings.max_header_bytes, settings.max_tensor_bytes)
        keys, server_key = service_keys(
            settings.keys, IDENTITY
        )  # before anything that needs closing
        self.ctx: zmq.Context[Any] = zmq.Context()
        try:
            self.sock = connect_dealer(
                self.ctx, settings.coordinator, IDENTITY, keys=keys, server_key=server_key
            )
        except zmq.ZMQError:
            self.ctx.destroy(linger=0)  # also closes the socket the failed connect left open
            raise
        self.store = Store(settings.redis_url, settings.cluster)
        self.stopping = threading.Event()

    def serve(self) -> None:
        """Announce, answer requests, until stopped."""
        next_hello = 0.0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_hello:
                    self._send(ServiceHello(service=IDENTITY, pid=os.getpid()))
                    next_hello = now + self.settings.heartbeat_s
                if self.sock.poll(int(self.settings.heartbeat_s * 1000), zmq.POLLIN):
                    self._receive()
        finally:
            self.sock.close(0)
            self.ctx.term()
            self.store.close()

    def _send(self, msg: PlanReply | ServiceHello) -> None:
        self.sock.send_multipart(encode(msg, IDENTITY))

    def _receive(self) -> None:
        try:
            _, env = recv_message(self.sock, self.limits)
        except ProtocolError as exc:
            log.warning("dropped bad message", peer="coordinator", reason=exc.reason)
            return
        if not isinstance(env.msg, PlanRequest):
            log.warning("unexpected message", type=env.msg.type)
            return
        req = env.msg
        t0 = time.perf_counter()
        try:
            plan, current_s = make_plan(self.store, req)
        except AsteroidError as exc:
            log.warning("planning failed", job=req.job_id, planner=req.planner, error=str(exc))
            self._send(PlanReply(job_id=req.job_id, ok=False, error=str(exc)))
            return
        log.info(
            "planned",
            job=req.job_id,
            planner=req.planner,
            stages=len(plan.stages),
            predicted_round_s=plan.predicted_round_s,
            seconds=time.perf_counter() - t0,
        )
        self._send(
            PlanReply(
                job_id=req.job_id,
                ok=True,
                plan=plan,
                predicted_round_s=plan.predicted_round_s or 0.0,
                current_round_s=current_s,
            )
        )


def run(settings: CommonSettings, stop: Stop) -> ExitCode:
    """Serve until SIGTERM or SIGINT (exit code OK); a bad setting is one log line, not a trace."""
    try:
        service = PlannerService(settings)
    except ConfigError as exc:
        log.error("planner cannot start", keys=str(settings.keys), error=str(exc))
        return ExitCode.CONFIG
    except zmq.ZMQError as exc:
        log.error("invalid coordinator address", address=settings.coordinator, error=str(exc))
        return ExitCode.CONFIG

    stop.on_stop(lambda _: service.stopping.set())
    service.serve()
    return ExitCode.OK


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-planner`."""
    sys.exit(run_service(IDENTITY, CommonSettings, run, argv))


if __name__ == "__main__":
    main()
