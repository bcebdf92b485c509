"""A send on the control link never blocks, so a worker that shuts down always exits.

Found by the integration suite: a worker's dispatcher thread reported a
neighbour's connection closed (the neighbours were shutting down too) after
the control thread had stopped relaying; its blocking send into the outbox
nobody read held the lock `close` needed, and the worker hung in its
shutdown until it was killed.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

from common.codec import Limits
from common.ids import DeviceId
from common.messages import Heartbeat, PeerDown
from common.ports import free_port
from services.worker.control import ControlLink

WAIT_S = 10.0


def _report() -> PeerDown:
    return PeerDown(device=DeviceId("w"), epoch=1, peer=DeviceId("n"), how="disconnected")


def test_a_send_after_the_relay_stopped_returns_and_close_completes() -> None:
    # the context is terminated only once every socket closed: on the old code a blocked
    # sender keeps one open, and the daemon threads below end with the test process
    ctx: zmq.Context[Any] = zmq.Context()
    beat = Heartbeat(device=DeviceId("w"), data_addr="tcp://127.0.0.1:1")
    addr = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: the link keeps trying
    link = ControlLink(ctx, addr, "w", Limits(), 600.0, lambda: beat, lambda _: None)
    link.start()
    link.stop.set()  # the relay thread ends and closes its end of the outbox
    link.join(timeout=WAIT_S)
    assert not link.is_alive()

    sender = threading.Thread(target=lambda: [link.send(_report()) for _ in range(3)], daemon=True)
    sender.start()
    sender.join(timeout=WAIT_S)
    assert not sender.is_alive(), "a send blocked on an outbox nobody reads"

    closer = threading.Thread(target=link.close, daemon=True)
    closer.start()
    closer.join(timeout=WAIT_S)
    assert not closer.is_alive(), "close waited for a blocked sender"
    link.send(_report())  # after close: dropped, never an error
    ctx.term()
