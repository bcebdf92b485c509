"""A worker gathering migrated layers gives up when a newer command waits behind it.

The migration's sender may die during the recovery; the coordinator then
assigns again without it, and the gathering worker must take that Assign
rather than wait out its task timeout (the end-to-end case is
`tests/chaos/test_found_migration.py`).
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

from common.codec import Envelope
from common.messages import Assign, Collect, RunRound, Shutdown
from services.worker.main import Worker
from tests.worker.test_peer_signals_message import _assign


def _worker(*queued: object) -> Worker:
    worker = Worker.__new__(Worker)
    inbox: queue.Queue[Envelope] = queue.Queue()
    for msg in queued:
        inbox.put(Envelope(msg=msg, sender="coordinator", msg_id=0, sent_at=0.0))  # type: ignore[arg-type]
    worker.control = SimpleNamespace(inbox=inbox)  # type: ignore[assignment]
    worker.stopping = threading.Event()
    return worker


def _assign_of(epoch: int) -> Assign:
    return Assign.model_validate({**_assign(None), "epoch": epoch})


def test_a_newer_assign_collect_or_shutdown_makes_the_gathering_moot() -> None:
    assert _worker()._superseded(3) is None
    assert _worker(RunRound(epoch=3, round=0))._superseded(3) is None
    assert _worker(_assign_of(3))._superseded(3) is None  # the same epoch again
    assert _worker(_assign_of(4))._superseded(3) == "assign received"
    assert _worker(Collect(epoch=3, version=0, layers=[]))._superseded(3) == "collect received"
    assert _worker(Shutdown())._superseded(3) == "shutdown received"
    stopping = _worker()
    stopping.stopping.set()
    assert stopping._superseded(3) == "the worker is stopping"
