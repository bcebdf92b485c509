"""A stranger heartbeating as a device: its name cannot drive the terminal, its record expires.

The attacks: a DEALER on the LAN registers a device whose name holds terminal
escapes ("\\x1b[2J" clears the operator's screen), a C1 CSI, a bidi override and
rich markup; `asteroid status` printed the name raw. And the device record the
coordinator wrote for it had no TTL, so once a ``--job`` coordinator exited, the
fake device stayed in Redis for good. Here a real coordinator takes the fake
device's heartbeats over a real socket, a real `asteroid status` lists it, and
the record is checked after the coordinator has exited.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.exit_codes import ExitCode
from common.messages import Heartbeat
from common.store import Store
from services.cli.console import shown, visible
from tests.cluster import LocalCluster
from tests.integration.test_equivalence import stage
from tests.security.attacker import Attacker

EVIL = "evil[blink]x\u202egnp.exe\x9b2J\x85\u2066"
"""A device name the transport lets through (printable UTF-8): a C1 CSI and NEL, bidi
controls and rich markup."""
RECORDED = "rec\x1b[2J\x1b]0;pwned\x07\x7f"
"""A name with ESC sequences (clear screen, set title), BEL and DEL, which the transport
refuses in a routing identity: written straight into the device records instead."""
UNSAFE = ("\x1b", "\x07", "\x7f", "\x9b", "\x85", "\u202e", "\u2066")


def test_visible_and_shown_write_controls_as_text() -> None:
    assert visible("a\x1b[2Jb\n\tc\x9bd\u202ee\x00") == "a\\x1b[2Jb\n\tc\\x9bd\\u202ee\\x00"
    assert shown("row\nspoof [red]x[/red]\u2066") == "row\\x0aspoof \\[red]x\\[/red]\\u2066"
    assert shown(ValueError("redis://u:pw@h/0")) == "redis://u:***@h/0"
    for char in UNSAFE:
        assert char not in shown(EVIL + RECORDED)


@pytest.mark.integration
def test_status_shows_a_hostile_device_name_inert_and_its_record_expires(
    tmp_path: Path, redis_url: str, cluster_name: str
) -> None:
    c = LocalCluster(tmp_path, redis_url, cluster_name)
    c.env["COLUMNS"] = "500"  # one table row per device, nothing wrapped away
    job = {"job_id": "waits", "model": {"name": "small_cnn"}, "seed": 1, "rounds": 1}
    plan = {"global_batch": 8, "microbatches": 2, "stages": [stage(0, 7, "absent")]}
    store = Store(redis_url, cluster_name)
    attacker = Attacker(c.addr, EVIL)
    key = store.key("device", EVIL)
    try:
        c.start_coordinator(job, plan)  # waits for "absent", which never comes
        deadline = time.monotonic() + c.budget.left(90)
        while not store.r.exists(key):  # heartbeats queue in the DEALER until it connects
            assert c.procs["coordinator"].poll() is None, c.log_tail("coordinator")
            assert time.monotonic() < deadline, c.log_tail("coordinator")
            attacker.send(Heartbeat(device=EVIL, data_addr="tcp://127.0.0.1:1"))
            time.sleep(0.3)
        store.set_fields({"state": "idle", "seen": time.time()}, "device", RECORDED)
        c.spawn("status", ["-m", "services.cli", "status"])
        code = c.wait("status", 60)
        attacker.send(Heartbeat(device=EVIL, data_addr="tcp://127.0.0.1:1"))
        c.close()  # the coordinator exits (SIGTERM) with the fake device still fresh
        assert c.procs["coordinator"].returncode is not None
        ttl_ms = int(store.r.pttl(key))  # -1: no TTL, -2: gone
    finally:
        attacker.close()
        store.r.delete(key, store.key("device", RECORDED))
        store.close()
    out = c.log("status")
    assert code == ExitCode.OK, out
    for char in UNSAFE:
        assert char not in out, f"status printed {char!r} from a peer:\n{out!r}"
    for name in (EVIL, RECORDED):
        assert visible(name) in out, out  # listed, every character of its name readable
    assert ttl_ms != -1, "the fake device's record outlives the coordinator forever"
