"""What one ring step of serving costs on this device, beyond the wire.

The cost model (coordinator) adds a fixed cost per ring step; each device
measures its own share of it when it profiles: one tile through the real serving
path, `ZmqRing.send` -> `Dispatcher` -> `Receiver` -> `TileInbox` ->
`ZmqRing.recv`, under the device's own CPU share. Its own module because it
uses the transport, which itself files tiles in `tiles.TileInbox`.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import torch
import zmq

from common.codec import Limits
from common.errors import RoundTimeoutError
from common.ids import DeviceId
from common.serving_messages import HmpTile
from services.worker.pool import TaskPool
from services.worker.tiles import Expecting, TileInbox, ZmqRing
from services.worker.transport import Dispatcher, Receiver

__all__ = ["STEP_PROBE_TIMEOUT_S", "measure_step_s"]


STEP_PROBE_TIMEOUT_S = 10.0
"""Longest one probing step may take; a device that slow gets this as its step cost."""


def measure_step_s(me: DeviceId, rows: int, hidden: int, repeats: int = 9) -> float:
    """Seconds of the ring's own work for one step of a `rows x hidden` tile, on this device.

    The tile goes the serving path round a ring of one, `ZmqRing.send` ->
    `Dispatcher` -> `Receiver` -> `TileInbox` -> `ZmqRing.recv`, over a private
    in-process link, so what is timed is the framing, the copies, the thread hops
    and wakeups, not the wire: the cost model adds the wire from the link's rate.
    Timed on the device under its own CPU share, as its blocks are; the median of
    `repeats` after one warm-up.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = TileInbox(max(1, 4 * rows * hidden * 4))
    addr = f"inproc://step-{uuid.uuid4().hex}"
    receiver = Receiver(ctx, addr, Limits(), TaskPool(1), tiles=inbox)
    dispatcher = Dispatcher(ctx, me, session="step")
    receiver.start()
    dispatcher.start()
    try:
        dispatcher.set_peers({me: receiver.endpoint})
        inbox.expect(Expecting("step-probe", 0, me))
        x = torch.zeros(max(rows, 1), hidden)
        times = []
        for request in range(1, repeats + 2):
            inbox.start(request)
            msg = HmpTile(serve_id="step-probe", epoch=0, round=request, tag="probe")
            ring = ZmqRing([me], me, msg, dispatcher, inbox, lambda: None)
            t0 = time.perf_counter()
            ring.send("probe/0", x)
            ring.recv("probe/0", STEP_PROBE_TIMEOUT_S)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    except RoundTimeoutError:
        return STEP_PROBE_TIMEOUT_S
    finally:
        dispatcher.close()
        dispatcher.join(STEP_PROBE_TIMEOUT_S)
        receiver.stop.set()
        receiver.join(STEP_PROBE_TIMEOUT_S)
        ctx.term()
