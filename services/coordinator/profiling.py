"""The profiling phase: a profile for every kind of device a job runs on, and the cluster.

Workers of one kind (same fingerprint: CPU, cores, threads, quota, memory)
share one profile, stored in Redis under `profile:<model key>:<fingerprint>`
and reused by every later job. A missing one is asked of a profiler service
running on such a device; a profiler on another kind of device says so and
the next one is asked.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from common.errors import AsteroidError, ConfigError
from common.ids import DeviceId
from common.job import JobSpec
from common.messages import Heartbeat, ProfileReply, ProfileRequest
from common.model_key import model_key
from common.profile import ClusterSpec, DeviceSpec, Profile
from services.coordinator.claims import memory_cap
from services.coordinator.host import Host
from services.coordinator.membership import Member

__all__ = [
    "batch_sizes",
    "cluster_for",
    "host_crowding",
    "profile_budgets",
    "profile_workers",
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


def _cached(coord: Host, key: str, sizes: list[int]) -> bool:
    data = coord.store.get_json("profile", key)
    if data is None:
        return False
    try:
        prof = Profile.model_validate(data)
    except ValidationError:
        return False
    return set(sizes) <= set(prof.batch_sizes)


def profile_workers(
    coord: Host, job: JobSpec, members: dict[DeviceId, Member]
) -> dict[DeviceId, str]:
    """The profile key of each worker, profiling each kind of device at most once.

    Raises:
        JobFailed-like AsteroidError: no profiler on a device of some worker's
            kind, or profiling failed there (the error names the worker).

    """
    micro = job.micro_batch or job.global_batch or 1
    sizes = batch_sizes(micro)
    mkey = model_key(job.model)
    keys: dict[DeviceId, str] = {}
    done: dict[str, str] = {}
    for device in sorted(members):
        hb = members[device].info
        if not hb.fingerprint:
            raise ConfigError(f"worker {device} did not report a device fingerprint")
        if hb.fingerprint not in done:
            key = f"{mkey}:{hb.fingerprint}"
            if not _cached(coord, key, sizes):
                req = ProfileRequest(
                    job_id=job.job_id,
                    model=job.model,
                    fingerprint=hb.fingerprint,
                    threads=hb.threads,
                    memory_budget=hb.memory_configured,
                    batch_sizes=sizes,
                    optimizer=job.optimizer.kind,
                )
                key = _ask_profilers(coord, req, device)
            done[hb.fingerprint] = key
        keys[device] = done[hb.fingerprint]
    return keys


def profile_budgets(coord: Host, keys: dict[DeviceId, str]) -> dict[str, int]:
    """The memory budget each profile measured, by profile key."""
    out = {}
    for key in set(keys.values()):
        data = coord.store.get_json("profile", key)
        out[key] = int(data.get("memory_budget", 0)) if isinstance(data, dict) else 0
    return out


def _ask_profilers(coord: Host, req: ProfileRequest, device: DeviceId) -> str:
    """Ask profiler services in turn until one on a device like `device` answers."""
    timeout = coord.settings.profile_timeout_s
    tried: list[str] = []
    for name in coord.profilers(timeout_s=min(timeout, coord.settings.join_timeout_s)):
        reply: ProfileReply = coord.request(
            name,
            req,
            lambda m: (
                isinstance(m, ProfileReply)
                and m.job_id == req.job_id
                and m.fingerprint == req.fingerprint
            ),
            timeout,
            what=f"profile of {req.fingerprint}",
        )
        if reply.ok:
            return reply.key
        if reply.mine:
            raise AsteroidError(f"profiling for worker {device} failed on {name}: {reply.error}")
        tried.append(name)
    raise AsteroidError(
        f"no profiler service runs on a device like worker {device} "
        f"(fingerprint {req.fingerprint}; asked {tried or 'none'}): start "
        "`asteroid-profiler --serve` on that device"
    )


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
