"""bench-galaxy's testbed side: serve one cell on the running testbed, change link rates.

A cell is a serving job sent as `asteroid serve` sends it (`ServeModel`),
awaited until the coordinator reports it running (profiled, planned, loaded),
then one warm-up and a few requests the way programs send them
(`infer_request`), then cancelled. The plan the coordinator ran is read from
the job's hash and priced by the cost model beside the measurement.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Mapping

from common.errors import AsteroidError
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from common.ids import DeviceId
from common.messages import CancelJob
from common.serving_messages import ServeModel, ServeSpec
from common.store import Store
from services.cli.client import ask_coordinator
from services.cli.serve import infer_request
from services.coordinator.galaxy.choose import STEP_LATENCY_S
from services.testbed import net
from services.testbed.bed import Testbed
from tests.bench.bench_recovery import REJOIN_TIMEOUT_S, restart, start_profiler
from tests.bench.galaxy_cells import (
    Cell,
    memory_unaware_plan,
    predicted_s,
    repredict,
    request_ids,
    shape,
)

__all__ = ["fresh_workers", "serve_cell", "set_link"]

SETUP_TIMEOUT_S = 900.0
"""Profiling, planning and loading a shard on a 0.137-core device take minutes at worst."""
REQUEST_TIMEOUT_S = 600.0
END_TIMEOUT_S = 60.0
ENDED = ("running", "failed", "cancelled", "done")


def set_link(bed: Testbed, bandwidth_bps: float) -> None:
    """Give every device's link (both ends) a new rate, in place: no service restarts.

    The testbed's own shaping commands are reused with `add` turned into
    `change` for the carrying class, its queue (sized to the new rate) and the
    drop class, so the shaping is what a testbed built at this rate would have.
    """
    for i, d in enumerate(bed.spec.devices):
        ends = ((net.NS_IFACE, bed.netns(d.name)), (net.host_veth(bed.tag, i), None))
        for iface, netns in ends:
            cmds = net.shaping_commands(
                iface, netns, bandwidth_bps, d.latency_ms, 0.0, bed.netem and d.latency_ms > 0
            )
            # [root qdisc, class 1:10, its queue 10:, class 1:20, ...]: change the middle three
            net.run_all([["change" if a == "add" else a for a in cmd] for cmd in cmds[1:4]])


def fresh_workers(bed: Testbed, store: Store) -> None:
    """Replace every device's worker (and profiler) by a new process and wait for its heartbeat.

    A worker keeps the last job's weights until the next job's shard is loaded,
    and its heap does not shrink back, so a bigger model's load can pass the
    device's memory limit after a few jobs; a new process starts from an idle
    worker's footprint, as on a device that serves one model.
    """
    t0 = time.time()
    for dev in bed.devices:
        bed.kill(dev)
    for dev in bed.devices:
        bed.start_worker(dev)
        start_profiler(bed, dev)
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    for dev in bed.devices:
        while float(store.get_fields("device", dev).get("seen", 0.0)) <= t0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{dev}'s new worker did not heartbeat in {REJOIN_TIMEOUT_S} s")
            time.sleep(0.5)
    time.sleep(2.0)  # a couple more heartbeats: the coordinator counts them alive


def _wait_state(store: Store, sid: str, states: tuple[str, ...], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = str(store.get_fields("job", sid).get("state", ""))
        if state in states:
            return state
        time.sleep(0.5)
    raise TimeoutError(f"serving job {sid} did not reach {states} within {timeout_s:.0f} s")


def _revive(bed: Testbed, store: Store, cell: Cell, oom_before: Mapping[str, int]) -> None:
    """Restart the workers a failed job killed; note kernel OOM kills on the cell."""
    for dev in bed.devices:
        killed = bed.oom_kills(dev) - oom_before.get(dev, 0)
        if killed:
            cell.note += f" {dev}: {killed} OOM kill(s) by its memory cgroup;"
        worker = bed.procs.get(f"{dev}.worker")
        if worker is not None and worker.poll() is not None:
            restart(bed, store, dev)


def serve_cell(
    bed: Testbed,
    store: Store,
    cell: Cell,
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
    requests: int,
    stop: threading.Event,
    step_latency_s: float | None = None,
) -> Cell:
    """Serve `cell` on `bed` unless its plan would not fit; fill in what was measured.

    `step_latency_s` is the link's fixed cost per ring step the coordinator's
    auto choice is told (None: its default).
    """
    served = shape(cell.model, cell.layers)
    config = served.config()
    bandwidth = cell.link_mbit * 1e6
    plan, oom = memory_unaware_plan(cell.mode, config, bed.devices, profiles, budgets)
    if oom:
        cell.state, cell.note = "oom", "; ".join(oom)
        if plan is not None:
            cell.plan = plan.model_dump(mode="json")
            cell.predicted_s, cell.predicted_comm_s = predicted_s(plan, config, profiles, bandwidth)
        return cell
    sid = f"gx-{cell.env}-{cell.model}-{cell.mode}-{int(cell.link_mbit)}-{time.time_ns() % 10**9}"
    spec = ServeSpec(
        serve_id=sid,
        model=served,
        seed=1,
        mode=cell.spec_mode,
        overlap=cell.overlap,
        devices=[DeviceId(d) for d in bed.devices],
        seq_len=len(request_ids()),
        link_bps=bandwidth,
        step_latency_s=step_latency_s,
    )
    oom_before = {d: bed.oom_kills(d) for d in bed.devices}
    t0 = time.monotonic()
    reply = ask_coordinator(bed.coordinator, ServeModel(spec=spec), 30)
    if not reply.ok:
        cell.state, cell.note = "failed", f"refused: {reply.error}"
        return cell
    try:
        state = _wait_state(store, sid, ENDED, SETUP_TIMEOUT_S)
        cell.setup_s = time.monotonic() - t0
        if state != "running":
            cell.state = "failed"
            cell.note = str(store.get_fields("job", sid).get("error", state))
            _revive(bed, store, cell, oom_before)
            return cell
        raw = store.get_fields("job", sid).get("plan")
        if raw is not None:
            ran = InferencePlan.model_validate_json(_json(raw))
            cell.plan = ran.model_dump(mode="json")
            cell.predicted_s, cell.predicted_comm_s = predicted_s(ran, config, profiles, bandwidth)
            sent = _devices_profiles(store.get_fields("job", sid).get("profiles"))
            if sent:
                cell.step_s = {d: p.step_s for d, p in sent.items()}
                cell.dev_profiles = {d: p.model_dump(mode="json") for d, p in sent.items()}
                repredict(cell, STEP_LATENCY_S if step_latency_s is None else step_latency_s)
        for n in range(requests + 1):
            if stop.is_set():
                raise KeyboardInterrupt("bench-galaxy was asked to stop")
            answer = infer_request(bed.coordinator, sid, request_ids(), 0, REQUEST_TIMEOUT_S)
            if not answer.ok:
                raise AsteroidError(f"request {n} failed: {answer.error}")
            if n:  # the first one warms up
                cell.latencies_s.append(answer.latency_s)
        cell.median_s = statistics.median(cell.latencies_s) if cell.latencies_s else None
        cell.state = "ok"
    except (AsteroidError, TimeoutError, OSError) as exc:
        cell.state, cell.note = "failed", str(exc).splitlines()[0]
        _revive(bed, store, cell, oom_before)
    finally:
        _end(bed, store, sid)
    return cell


def _devices_profiles(raw: object) -> dict[str, BlockProfile]:
    """The profiles the devices sent, as the job's running record keeps them (none: empty)."""
    if raw is None:
        return {}
    data = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(data, dict):
        return {}
    return {str(d): BlockProfile.model_validate(p) for d, p in data.items()}


def _json(raw: object) -> str:
    """The plan as JSON text: the store decodes hash fields, a nested dict stays one."""
    return raw if isinstance(raw, str) else json.dumps(raw)


def _end(bed: Testbed, store: Store, sid: str) -> None:
    """Cancel the job (if it still runs) and wait until the coordinator is free again."""
    state = str(store.get_fields("job", sid).get("state", ""))
    if state in ("failed", "cancelled", "done"):
        return
    try:
        ask_coordinator(bed.coordinator, CancelJob(job_id=sid), 30)
        _wait_state(store, sid, ("failed", "cancelled", "done"), END_TIMEOUT_S)
    except (AsteroidError, TimeoutError, OSError):
        pass  # the next job's own wait shows whether the coordinator is stuck
