"""A minimal coordinator for tests: the control protocol over a real ROUTER.

It speaks exactly the messages a coordinator sends and gathers the replies,
so a test can place commands (an evaluation between two rounds, a command
the workers must refuse) where the job driver would not.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from common.codec import Limits, recv_message, send_message
from common.errors import ProtocolError
from common.messages import Heartbeat, Message, WorkerError
from common.sockets import bind_router
from tests.cluster import Budget


class Driver:
    """Binds the coordinator address; collects heartbeats and replies."""

    def __init__(self, addr: str, budget: Budget | None = None) -> None:
        self.budget = budget or Budget()
        self.limits = Limits()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock, _ = bind_router(self.ctx, addr, self.limits)
        self.data_addrs: dict[str, str] = {}
        self.routes: dict[str, bytes] = {}
        self.inbox: list[tuple[str, Any]] = []

    def pump(self, timeout_s: float) -> None:
        """Receive whatever arrives within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            try:
                peer, env = recv_message(self.sock, self.limits, routed=True)
            except ProtocolError:
                continue
            self.routes[peer] = env.route
            if isinstance(env.msg, Heartbeat):
                self.data_addrs[peer] = env.msg.data_addr
            else:
                self.inbox.append((peer, env.msg))
            if time.monotonic() >= deadline:
                break

    def wait_for(self, devices: list[str], timeout_s: float = 60) -> dict[str, str]:
        """Data-plane addresses of `devices`, once each has sent a heartbeat."""
        deadline = time.monotonic() + self.budget.left(timeout_s)
        while missing := [d for d in devices if d not in self.data_addrs]:
            assert time.monotonic() < deadline, f"workers {missing} did not join"
            self.pump(0.1)
        return {d: self.data_addrs[d] for d in devices}

    def send(self, devices: list[str], msg: Message) -> None:
        for d in devices:
            send_message(self.sock, msg, "coordinator", route=self.routes[d])

    def gather(
        self, kind: type, devices: list[str], epoch: int, round_no: int, timeout_s: float = 120
    ) -> dict[str, Any]:
        """One `kind` reply of (epoch, round) per device; a WorkerError fails the test."""
        got: dict[str, Any] = {}
        deadline = time.monotonic() + self.budget.left(timeout_s)
        while len(got) < len(devices):
            assert time.monotonic() < deadline, f"no {kind.__name__} from {set(devices) - set(got)}"
            self.pump(0.05)
            keep = []
            for peer, msg in self.inbox:
                if isinstance(msg, WorkerError) and kind is not WorkerError:
                    raise AssertionError(f"worker {peer} failed: {msg.error}")
                if (
                    isinstance(msg, kind)
                    and peer in devices
                    and (msg.epoch, msg.round)
                    == (
                        epoch,
                        round_no,
                    )
                ):
                    got[peer] = msg
                else:
                    keep.append((peer, msg))
            self.inbox = keep
        return got

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
