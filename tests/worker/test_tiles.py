"""The tile inbox's checks, and the ring step probe the cost model's per-step cost comes from."""

import pytest
import torch

from common.errors import RoundAbortedError
from common.ids import DeviceId
from common.serving_messages import HmpTile
from services.worker.step_cost import STEP_PROBE_TIMEOUT_S, measure_step_s
from services.worker.tiles import Expecting, TileInbox

A, B = DeviceId("a"), DeviceId("b")


def _tile(round_=1, tag="x/0", serve_id="s", epoch=0):
    return HmpTile(serve_id=serve_id, epoch=epoch, round=round_, tag=tag)


def test_the_inbox_takes_only_the_loaded_jobs_tiles_from_the_predecessor():
    inbox = TileInbox(1 << 20)
    t = torch.ones(2, 4)
    assert inbox.put(_tile(), t, A) == "no model is loaded here"
    inbox.expect(Expecting("s", 0, A))
    assert "loaded s/0" in (inbox.put(_tile(epoch=1), t, A) or "")
    assert inbox.put(_tile(), t, B) == "tiles come from a in this ring, not b"
    assert inbox.put(_tile(), t, A) is None
    assert "duplicate" in (inbox.put(_tile(), t, A) or "")
    inbox.start(2)
    assert "request 1 is over" in (inbox.put(_tile(round_=1, tag="y"), t, A) or "")
    assert inbox.take(1, "x/0", 0.0, lambda: None) is None  # dropped when request 2 began
    assert inbox.put(_tile(round_=2), torch.ones(1 << 20), A) is not None  # over max_bytes
    assert inbox.put(_tile(round_=2), t, A) is None
    got = inbox.take(2, "x/0", 1.0, lambda: None)
    assert got is not None and torch.equal(got, t)
    with pytest.raises(RoundAbortedError, match="cancelled"):
        inbox.take(2, "x/1", 1.0, lambda: "cancelled")


def test_a_ring_step_probe_times_the_serving_path_on_this_device():
    seconds = measure_step_s(A, 8, 16, repeats=3)
    assert 0 < seconds < STEP_PROBE_TIMEOUT_S
