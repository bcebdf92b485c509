"""What profiling decides, as pure functions: the batch sizes to profile, and the cluster.

Workers of one kind (same fingerprint: CPU, cores, threads, quota, memory)
share one profile, stored in Redis under `profile:<model key>:<fingerprint>`
and reused by every later job; a missing one is asked of a profiler service
running on such a device (`prepare_steps`). The planner then sees each worker
with its profile, memory and slowdown (`cluster_for`).
"""

from __future__ import annotations

from collections.abc import Mapping

from common.errors import ConfigError
from common.ids import DeviceId
from common.messages import Heartbeat
from common.profile import ClusterSpec, DeviceSpec
from services.coordinator.claims import memory_cap
from services.coordinator.membership import Member

__all__ = [
    "batch_sizes",
    "cluster_for",
    "host_crowding",
]


def batch_sizes(micro: int) -> list[int]:
    """Batch sizes to profile: powers of two below the micro-batch, and the micro-batch.

    A device's share of a micro-batch is at most the micro-batch, and time is
    not linear in batch size, so the planner interpolates between these.
    """
    sizes = [1]
    while sizes[-1] * 2 < micro:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, micro})


def host_crowding(members: dict[DeviceId, Member]) -> dict[DeviceId, float]:
    """How much slower each worker runs than profiled because others share its machine.

    Profiles are measured with one process busy; workers on one host (a local
    cluster, several emulated devices) that together keep more cores busy than
    it has (threads, capped by each one's CPU quota) each get a proportionally
    smaller share of it. Quotas themselves are in the profile already.
    """

    def demand(hb: Heartbeat) -> float:  # cores a worker can keep busy
        return min(hb.threads, hb.cpu_quota) if hb.cpu_quota else hb.threads

    busy: dict[str, float] = {}
    for m in members.values():
        if m.info.host:
            busy[m.info.host] = busy.get(m.info.host, 0.0) + demand(m.info)
    out = {}
    for d, m in members.items():
        hb = m.info
        load = busy[hb.host] if hb.host else demand(hb)
        out[d] = max(1.0, load / hb.cores) if hb.cores else 1.0
    return out


def cluster_for(
    members: dict[DeviceId, Member],
    keys: dict[DeviceId, str],
    budgets: dict[str, int],
    base: ClusterSpec | None,
    default_bandwidth: float,
    measured: Mapping[str, float] | None = None,
    slowdowns: Mapping[DeviceId, float] | None = None,
) -> ClusterSpec:
    """The cluster the planner sees: each worker with its profile and memory budget.

    A worker's memory is the training budget it reports (configured, or its
    cgroup limit minus what it holds after start-up, or free memory; never
    more than the memory its fingerprint names, `claims.memory_cap`), else
    what `base` (a cluster spec file given to the coordinator) says, else what
    its profile measured (`budgets`, by profile key). Links come from `base`
    when it gives any; else from `measured` (bytes/s by "a|b" pair), with the
    bandwidth of `base`, else `default_bandwidth`, for pairs not measured.
    `base` also sets slowdowns, multiplied by `host_crowding` and by what a
    running job measured (`slowdowns`: how much slower a device computes than
    when its plan was made).
    """
    measured_slowdown = dict(slowdowns or {})
    named = {d.name: d for d in base.devices} if base else {}
    crowding = host_crowding(members)
    devices = []
    for d in sorted(members):
        hb = members[d].info
        known = named.get(d)
        claimed = min(hb.memory_budget, memory_cap(hb))
        memory = claimed or (known.memory_bytes if known else 0) or budgets[keys[d]]
        if memory <= 0:
            raise ConfigError(
                f"worker {d} reported no memory budget; start it with --memory-budget BYTES"
            )
        devices.append(
            DeviceSpec(
                name=d,
                memory_bytes=memory,
                profile=keys[d],
                slowdown=(known.slowdown if known else 1.0)
                * crowding[d]
                * measured_slowdown.get(d, 1.0),
            )
        )
    links = dict(base.links) if base is not None and base.links else dict(measured or {})
    return ClusterSpec(
        devices=devices,
        bandwidth=base.bandwidth if base is not None else default_bandwidth,
        links=links,
        latency_s=base.latency_s if base is not None else 0.0,
    )
