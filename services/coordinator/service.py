"""The coordinator: registry, job queue, and the I/O a running job's core needs.

One thread, one ROUTER: `pump()` takes whatever arrived (heartbeats update the
membership, hellos the service list, people's submit and cancel requests are
answered at once, everything else waits in the inbox). A running job
(`jobs.JobRun`) reads what arrived as events (`events`) and feeds them to its
pure core (`driver.apply`), which decides every step, including when a worker
that reports an error, is lost (its heartbeats stopped and it did not answer a
probe) or hung (it heartbeats but makes no progress for longer than the
watchdog) fails or recovers the job. `gather` waits for one step's replies
outside a job by the same rules (`core.apply`).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import yaml
import zmq
from pydantic import ValidationError

from common.checkpoint import latest_round
from common.codec import Limits, recv_message, send_message
from common.curve import is_loopback, load_keys
from common.errors import AsteroidError, ConfigError, PlanError, ProtocolError
from common.ids import DeviceId
from common.inbound import MemoryGuard
from common.job import JobSpec, check_job_id
from common.lifecycle import ACTIVE
from common.locate import location_of
from common.logging import get_logger
from common.messages import (
    CancelJob,
    DrainDevice,
    Heartbeat,
    JobReply,
    LinksMeasured,
    LocateRedis,
    Message,
    PlanReply,
    PlanRequest,
    Probe,
    ProbeReply,
    ReplicaSaved,
    ServiceHello,
    Shutdown,
    SubmitJob,
)
from common.plan import Plan
from common.profile import ClusterSpec
from common.secrets import mask_text
from common.serving_messages import InferReply, InferRequest, ServeModel, ServeSpec
from common.settings import CoordinatorSettings
from common.sockets import bind_router, reset_router
from common.store import OUTAGE, REFUSED, Store
from common.version import VERSION
from services.coordinator.checks import CheckedJob, check_job
from services.coordinator.core import (
    Beats,
    Complete,
    Event,
    Fail,
    Heard,
    Log,
    Lost,
    ProbeAnswer,
    Reply,
    SendProbe,
    Tick,
    apply,
    begin,
)
from services.coordinator.federated import FederatedRun
from services.coordinator.jobs import DeviceLost, JobCancelled, JobFailed, JobRun, JobSummary
from services.coordinator.membership import (
    Members,
    Probes,
    Rules,
    Verdict,
    admit,
    dead,
    expired,
    forget,
    heard,
    on_probe_reply,
)
from services.coordinator.model_probe import probe_limits
from services.coordinator.serving import PendingRequest, ServeRun, infer_queue
from services.coordinator.versions import forget_versions, note_version

__all__ = ["Coordinator", "JobCancelled", "JobFailed", "JobSummary"]

log = get_logger(__name__)
T = TypeVar("T")
NAME = "coordinator"
PLANNER = "planner"
_CLIENT_REQUESTS = ("submit_job", "cancel_job", "drain_device", "serve_model", "infer_request")
"""Requests whose sender is told why a malformed one was refused."""
PUMP_MAX_MESSAGES = 500
"""Most messages one `pump` call handles before its caller looks at its deadlines again."""
PUMP_MAX_S = 0.05
"""Longest one `pump` call spends handling messages, for the same reason."""
REPLICA_NEWS_MAX = 1_000
"""Replica reports kept for the running job between two rounds."""
MAX_ROUTES = 4_096
"""Peers whose latest connection is remembered: far beyond a cluster's devices, services
and clients; a device heartbeats every second, so it is never the least recent."""
DEVICE_WRITE_EVERY_S = 1.0
"""Least time between two Redis writes of one device's heartbeat state."""
DEVICE_RECORD_GRACE_S = 10.0
"""A device's Redis record outlives its last heartbeat write by the expiry time plus this:
renewed while it heartbeats, gone soon after it (or the coordinator) stops."""
CONTROL_ROLES = ("worker", "service", "operator")
"""Key roles the control socket admits; what each may send is `SENDER_ROLES`."""
SENDER_ROLES = {
    "heartbeat": "worker",
    "assigned": "worker",
    "round_done": "worker",
    "eval_done": "worker",
    "checkpoint_saved": "worker",
    "worker_error": "worker",
    "probe_reply": "worker",
    "replica_saved": "worker",
    "links_measured": "worker",
    "blocks_profiled": "worker",
    "shard_loaded": "worker",
    "inference_done": "worker",
    "service_hello": "service",
    "plan_reply": "service",
    "profile_reply": "service",
    "submit_job": "operator",
    "cancel_job": "operator",
    "drain_device": "operator",
    "serve_model": "operator",
    "infer_request": "operator",
}
"""The key role that may send each message type to the coordinator (with CURVE)."""
ANY_ROLE = ("locate_redis",)
"""Requests any key of the set may send: their answers hold nothing secret."""


def role_refusal(user: str, kind: str) -> str | None:
    """Why a message of type `kind` from authenticated key `user` is refused, or None.

    `user` is "ROLE:NAME" from the CURVE handshake ("" without keys, where the
    socket is on loopback and every local process is trusted alike).
    """
    if not user or kind in ANY_ROLE:
        return None
    role = user.partition(":")[0]
    wanted = SENDER_ROLES.get(kind)
    if wanted == role:
        return None
    expected = f"a key of role {wanted}" if wanted else "no key (nobody may send it)"
    return f"{kind} from {role} key {user!r}: expected {expected}"


class Coordinator:
    """Drives jobs over a ROUTER socket; state and checkpoints go to Redis."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        # the control plane carries no tensors: a frame beyond one header is refused by
        # ZeroMQ itself, so the queue of unread messages is bounded in bytes too
        self.limits = Limits(settings.max_header_bytes, max_tensor_bytes=0, max_tensors=0)
        keys = load_keys(settings.keys, "coordinator")
        if keys is None and not is_loopback(settings.bind):
            raise ConfigError(
                f"refusing to bind {settings.bind} without CURVE keys: anyone on that network "
                "could join as a worker or submit jobs. Make a key set with `asteroid keys "
                "init DIR --worker NAME ... --operator NAME` and pass --keys DIR (or "
                "ASTEROID_KEYS), or bind to 127.0.0.1"
            )
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock, self.endpoint = bind_router(
            self.ctx, settings.bind, self.limits, keys=keys, roles=CONTROL_ROLES
        )
        self._keys = keys
        self.guard = MemoryGuard.above_now(settings.inbound_margin)
        """Resets the control socket should peers' unfinished messages outgrow the margin."""
        self.store = Store(settings.redis_url, settings.cluster)
        self.members: Members = {}
        self.versions: Mapping[DeviceId, str] = {}
        """The release each member last reported, so another release is warned of once."""
        # never forget a device before it would be declared dead: a job waiting on it
        # must see it dead, not absent
        dead_s = settings.heartbeat_s * settings.heartbeat_misses
        self.rules = Rules(
            DEVICE_WRITE_EVERY_S,
            max(settings.device_expiry_s, dead_s),
            settings.max_unassigned_devices,
        )
        self.probes: Probes = {}
        """Probes sent to suspects and not answered yet."""
        self._next_nonce = 1
        """The nonce of the next probe; never reused while this coordinator lives."""
        self.collecting = False
        """A wait or a running job reads the inbox: probe answers go there too."""
        self.fence = 0
        """This coordinator's fencing epoch (`raise_fence`); 0 until raised."""
        self.assigned: frozenset[DeviceId] = frozenset()
        """Devices the running job's plan names: never forgotten nor capped while it runs."""
        self.heartbeat_counts = {v: 0 for v in Verdict} | {"expired": 0, "unrecorded": 0}
        """Heartbeats by what became of them, devices forgotten, and device writes Redis
        missed during an outage; logged when they change."""
        self._logged_counts = dict(self.heartbeat_counts)
        self._next_sweep = 0.0
        self.routes: OrderedDict[str, bytes] = OrderedDict()
        """Each peer's latest connection (`common.codec.peer_of_route`), which sends go to."""
        self.inbox: deque[tuple[DeviceId, Message]] = deque()
        self.replica_news: deque[ReplicaSaved] = deque(maxlen=REPLICA_NEWS_MAX)
        """Replicas reported complete since the running job last looked (bounded: a
        flood pushes out the oldest, and the job only trusts ones its plan names)."""
        self.links_pending: set[tuple[DeviceId, int]] = set()
        """Link measurements asked (worker, nonce) and not answered: only their answers count."""
        self._next_link_nonce = 1
        self.bad_messages = 0
        self.services: dict[str, float] = {}
        self.queue: deque[CheckedJob | ServeSpec] = deque()
        """Jobs waiting to run, training (checked) and serving, in arrival order."""
        self.infer_queue = infer_queue()
        """Inference requests for the running serving job, waiting their turn."""
        self.running: str | None = None
        self.federated: str | None = None
        """A federated job being run, whose local pieces are `running` in turn."""
        self.cancelled: dict[str, str] = {}
        self.drains: dict[DeviceId, str] = {}
        """Devices of the running job to drain, and why (at most the job's own devices)."""
        self.unwritten: deque[tuple[str, Callable[[], object]]] = deque()
        """Writes Redis missed during an outage that must still land (a job's end state)."""
        self._next_flush = 0.0

    # --- Redis outages ------------------------------------------------------------

    def durable(self, what: str, op: Callable[[], T]) -> T:
        """`op()`, the Redis step a job needs before it goes on, waiting out an outage.

        While Redis is away the coordinator keeps answering its socket (heartbeats,
        submits, cancels) between attempts, so a running job pauses where it is
        (at a round boundary: no round starts before the last one is committed)
        and resumes when Redis is back, or fails with StoreUnavailable after
        `redis_outage_s`.
        """
        return self.store.ride_out(op, what, self.settings.redis_outage_s, idle=self._idle)

    def _idle(self, seconds: float) -> None:
        """Serve the socket for `seconds`; a cancel of the running job takes effect here too."""
        self.pump(seconds)
        if self.running:
            self.check_cancelled(self.running)

    def write_soon(self, what: str, op: Callable[[], object]) -> None:
        """`op()` now, or once Redis is back: for writes nothing waits on but that must land.

        A job that ends during an outage must not stay `running` in Redis while
        this coordinator lives: its end state is kept and written by `pump` as
        soon as Redis answers again, in order.
        """
        if not self.unwritten:
            try:
                op()
                return
            except OUTAGE as exc:
                log.warning(
                    "Redis unreachable; will write when it is back",
                    write=what,
                    redis=self.store.where,
                    error=mask_text(str(exc)),
                )
            except REFUSED as exc:  # full, say: it may take the write once room is made
                log.warning(
                    "Redis refused a write; will try again",
                    write=what,
                    redis=self.store.where,
                    error=mask_text(str(exc)),
                )
        self.unwritten.append((what, op))

    def _flush_unwritten(self, now: float) -> None:
        """Write what an outage held back, oldest first; stop at the first failure."""
        if not self.unwritten or now < self._next_flush:
            return
        self._next_flush = now + 1.0
        while self.unwritten:
            what, op = self.unwritten[0]
            try:
                op()
            except (*OUTAGE, *REFUSED):
                return
            self.unwritten.popleft()
            log.info("wrote what Redis missed", write=what)

    # --- transport --------------------------------------------------------------

    def send(self, device: DeviceId, msg: Message) -> None:
        """Send a control message to a peer, stamped with this coordinator's fence.

        It goes to the connection `device` last spoke on; one it never spoke on
        gets nothing (as ZeroMQ drops a message to an unknown route).
        """
        route = self.routes.get(device)
        if route is not None:
            send_message(self.sock, msg, NAME, route=route, fence=self.fence)

    def _remember_route(self, peer: str, route: bytes) -> None:
        """`peer`'s latest connection, newest last; the least recent beyond `MAX_ROUTES` go."""
        self.routes[peer] = route
        self.routes.move_to_end(peer)
        while len(self.routes) > MAX_ROUTES:
            self.routes.popitem(last=False)

    def raise_fence(self) -> int:
        """Take the next fencing epoch from Redis: workers then refuse older coordinators.

        Raised once at every start, so a coordinator that was replaced (restarted
        elsewhere, or thought dead) can no longer steer the cluster's workers.
        """
        self.fence = int(
            self.durable("raising the fence", lambda: self.store.r.incr(self.store.key("fence")))
        )
        log.info("coordinator fence raised", fence=self.fence)
        return self.fence

    def pump(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a message, then process those waiting, within bounds.

        Returns as soon as the socket is drained, so a caller waiting for a
        reply sees it without sitting out the rest of its poll interval; and
        after `PUMP_MAX_MESSAGES` messages or `PUMP_MAX_S` seconds at most, so a
        flood cannot keep a caller from its deadlines (the rest waits in the
        socket for the next call). Forgets expired devices on the way out.
        """
        if self.guard.exceeded():
            log.warning(
                "reset the control socket: the coordinator outgrew its memory limit (a peer "
                "sending an unfinished message?)",
                limit=self.guard.limit,
                resets=self.guard.resets,
            )
            self.sock = reset_router(self.sock, self.ctx, self.limits, self._keys, CONTROL_ROLES)
        wait_ms = int(timeout_s * 1000)
        handled = 0
        stop = math.inf
        while handled < PUMP_MAX_MESSAGES and time.monotonic() < stop:
            if not self.sock.poll(wait_ms, zmq.POLLIN):
                break
            if handled == 0:
                stop = time.monotonic() + PUMP_MAX_S
            wait_ms = 0
            handled += 1
            try:
                peer, env = recv_message(self.sock, self.limits, routed=True)
            except ProtocolError as exc:
                self.bad_messages += 1
                log.warning("dropped bad control message", peer=exc.sender, reason=exc.reason)
                self._refuse_request(exc)
                continue
            self._remember_route(peer, env.route)
            claimed = getattr(env.msg, "device", None)
            if claimed is not None and (claimed != peer or "/" in claimed):
                # NAME/SESSION is one of key NAME's connections, never a device of its own
                self.bad_messages += 1
                log.warning(
                    "dropped message whose device differs from its sender",
                    peer=peer,
                    claimed=claimed,
                    type=env.msg.type,
                )
            elif (why := role_refusal(env.user, env.msg.type)) is not None:
                self.bad_messages += 1
                log.warning("dropped message outside its key's role", peer=peer, reason=why)
                if env.msg.type in _CLIENT_REQUESTS:  # say so
                    self.send(DeviceId(peer), JobReply(job_id="", ok=False, error=why))
            elif isinstance(env.msg, Heartbeat):
                self._heartbeat(env.msg)
            elif isinstance(env.msg, LocateRedis):  # no secret in the answer: any key may ask
                where = location_of(self.settings.redis_url, self.settings.cluster, env.msg.nonce)
                self.send(DeviceId(peer), where)
            elif isinstance(env.msg, ProbeReply):
                self._probe_reply(env.msg)
            elif isinstance(env.msg, ReplicaSaved):
                self.replica_news.append(env.msg)  # the running job checks it against its plan
            elif isinstance(env.msg, ServiceHello):
                if env.msg.service not in self.services:
                    log.info("service joined", service=env.msg.service, peer=peer)
                self.services[env.msg.service] = time.monotonic()
            elif isinstance(env.msg, SubmitJob | CancelJob | DrainDevice):
                self._client(peer, env.msg)
            elif isinstance(env.msg, ServeModel):
                self._on_serve(peer, env.msg)
            elif isinstance(env.msg, InferRequest):
                self._on_infer(peer, env.msg)
            elif isinstance(env.msg, LinksMeasured):
                self._links_measured(env.msg)
            else:
                self.inbox.append((DeviceId(peer), env.msg))
        self._sweep()

    def _links_measured(self, msg: LinksMeasured) -> None:
        """Keep a link measurement's answer only if it was asked for (and not yet answered)."""
        if (msg.device, msg.nonce) in self.links_pending:
            self.links_pending.discard((msg.device, msg.nonce))
            self.inbox.append((msg.device, msg))
            return
        self.bad_messages += 1
        log.warning(
            "dropped a link measurement nobody asked for (or one answered late)",
            peer=msg.device,
            nonce=msg.nonce,
        )

    def link_nonce(self, device: DeviceId) -> int:
        """A fresh nonce for a MeasureLinks to `device`, whose answer is now awaited."""
        nonce, self._next_link_nonce = self._next_link_nonce, self._next_link_nonce + 1
        self.links_pending.add((device, nonce))
        return nonce

    def _keep(self) -> frozenset[DeviceId]:
        """Devices exempt from expiry and the cap: the running job's, none between jobs."""
        return self.assigned if self.running else frozenset()

    def _heartbeat(self, hb: Heartbeat) -> None:
        """Remember `hb`; write it to Redis at once for a new device, else at most once a second.

        A new id beyond the cap of unassigned devices is dropped; the first
        such drop is logged with its sender, later ones only counted.
        """
        self.members, verdict = admit(self.members, hb, time.monotonic(), self.rules, self._keep())
        self.heartbeat_counts[verdict] += 1
        if verdict is Verdict.DROPPED:
            if self.heartbeat_counts[verdict] == 1:
                log.warning(
                    "dropped heartbeat of a new device: too many unassigned devices",
                    peer=hb.device,
                    expected=f"at most {self.rules.max_unassigned}",
                )
            return
        if verdict is Verdict.JOINED:
            log.info("worker joined", worker=hb.device, data=hb.data_addr, version=hb.version)
        self.versions, warn = note_version(self.versions, hb.device, hb.version, VERSION)
        if warn:
            log.warning(
                "worker runs another release than the coordinator",
                worker=hb.device,
                worker_version=hb.version,
                coordinator_version=VERSION,
            )
        if verdict is not Verdict.LIMITED:
            try:
                self.store.set_fields(
                    {**hb.model_dump(mode="json"), "seen": time.time()},
                    "device",
                    hb.device,
                    ttl_s=self.rules.expiry_s + DEVICE_RECORD_GRACE_S,  # gone with the sender
                )
            except (*OUTAGE, *REFUSED):  # the next heartbeat's write a second later catches up
                self.heartbeat_counts["unrecorded"] += 1

    def _probe_reply(self, msg: ProbeReply) -> None:
        """A suspect answered: it is there, whatever became of its heartbeats.

        During a step's wait the answer is the wait's to judge (`core.apply`);
        between steps a probe still open from the last one is cleared here.
        """
        if self.collecting:  # a wait or a job judges it, in order with the replies
            self.inbox.append((msg.device, msg))
            return
        self.members, self.probes, counted = on_probe_reply(
            self.members, self.probes, msg.device, msg.nonce, time.monotonic()
        )
        if counted:
            log.info("suspect answered the probe", device=msg.device)
        else:  # late (the device was declared dead meanwhile) or stale
            log.info("ignored a probe answer nobody waits for", device=msg.device, nonce=msg.nonce)

    def _sweep(self) -> None:
        """Forget devices not heard from for the expiry time (memory and their Redis key).

        Runs at most a few times a second; also logs the heartbeat counters
        when they changed, so a flood shows in the log without a line per message.
        """
        now = time.monotonic()
        self._flush_unwritten(now)
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.rules.expiry_s / 4)
        gone = expired(self.members, now, self.rules.expiry_s, self._keep())
        if gone:
            self.members = forget(self.members, gone)
            self.versions = forget_versions(self.versions, gone)
            # exact keys, one per device: never a pattern built from a peer's name
            keys = [self.store.key("device", d) for d in gone]
            self.write_soon("forget silent devices", lambda: self.store.r.delete(*keys))
            self.heartbeat_counts["expired"] += len(gone)
            log.info("forgot silent devices", count=len(gone), first=gone[0])
        if self.heartbeat_counts != self._logged_counts:
            self._logged_counts = dict(self.heartbeat_counts)
            log.info(
                "heartbeat counts",
                **{str(getattr(k, "value", k)): v for k, v in self.heartbeat_counts.items()},
                known=len(self.members),
            )

    def wait_for_devices(self, devices: list[DeviceId], timeout_s: float) -> None:
        """Block until every device in `devices` has sent a heartbeat.

        `devices` are the running job's: from now on they are exempt from
        expiry and from the cap on unassigned devices.
        """
        self.assigned = frozenset(devices)
        deadline = time.monotonic() + timeout_s
        while missing := [d for d in devices if d not in self.members]:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"workers {missing} did not join within {timeout_s:g} s "
                    f"(joined: {sorted(self.members)})"
                )
            self.pump(0.1)

    def alive(self) -> Members:
        """Workers whose heartbeats are current."""
        now = time.monotonic()
        gone = set(
            dead(self.members, now, self.settings.heartbeat_s, self.settings.heartbeat_misses)
        )
        return {d: m for d, m in self.members.items() if d not in gone}

    def wait_for_count(self, count: int, timeout_s: float) -> None:
        """Block until at least `count` workers are alive."""
        deadline = time.monotonic() + timeout_s
        while len(self.alive()) < count:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"min_workers: {count} workers wanted, {len(self.alive())} joined within "
                    f"{timeout_s:g} s ({sorted(self.alive())})"
                )
            if self.running:
                self.check_cancelled(self.running)
            self.pump(0.1)

    def cluster_base(self) -> ClusterSpec | None:
        """The cluster spec file given with --cluster-spec, if any."""
        path: Path | None = self.settings.cluster_spec
        if path is None:
            return None
        try:
            return ClusterSpec.model_validate(yaml.safe_load(path.read_text()))
        except (OSError, yaml.YAMLError, ValidationError) as exc:
            raise ConfigError(f"cluster spec {path} is invalid: {exc}") from exc

    def profilers(self, timeout_s: float) -> list[str]:
        """Profiler services heard from recently, waiting up to `timeout_s` for one."""
        deadline = time.monotonic() + timeout_s
        while True:
            fresh = (
                time.monotonic() - 10 * self.settings.heartbeat_s * self.settings.heartbeat_misses
            )
            found = sorted(
                n for n, t in self.services.items() if n.startswith("profiler") and t > fresh
            )
            if found or time.monotonic() > deadline:
                return found
            self.pump(0.1)

    def request(
        self,
        service: str,
        msg: Message,
        match: Callable[[Message], bool],
        timeout_s: float,
        what: str,
    ) -> Any:
        """Send `msg` to a service and wait for the first reply `match` accepts."""
        self.send(DeviceId(service), msg)
        deadline = time.monotonic() + timeout_s
        while True:
            for _ in range(len(self.inbox)):
                peer, got = self.inbox.popleft()
                if peer == service and match(got):
                    return got
                self.inbox.append((peer, got))
            if self.running:
                self.check_cancelled(self.running)
            if time.monotonic() > deadline:
                raise JobFailed(f"{service} did not send the {what} within {timeout_s:g} s")
            self.pump(0.1)

    def events(self, poll_s: float = 0.05) -> Iterator[Event]:
        """What happened since the last look, as events for a wait's or a job's core.

        Pumps the socket once, then yields the membership, each replica report
        and inbox message (probe answers among them), and a tick. Messages are
        taken from the inbox one at a time: what a caller leaves after a verdict
        stays there, in order, for the next step. Callers set `collecting` while
        they read events, so that probe answers come this way too.
        """
        self.pump(poll_s)
        yield Beats(self.members)
        while self.replica_news:
            news = self.replica_news.popleft()
            yield Reply(news.device, news)
        for _ in range(len(self.inbox)):
            peer, msg = self.inbox.popleft()
            yield ProbeAnswer(peer, msg.nonce) if isinstance(msg, ProbeReply) else Reply(peer, msg)
        yield Tick()

    def carry_out(self, cmd: SendProbe | Heard | Log) -> None:
        """Do what a wait's core asked: probe a suspect, count an answer as heard, log."""
        if isinstance(cmd, SendProbe):
            log.warning(
                "probing suspect",
                device=cmd.device,
                silent_s=round(cmd.silent_s, 2),
                nonce=cmd.nonce,
            )
            self.send(cmd.device, Probe(nonce=cmd.nonce))
        elif isinstance(cmd, Heard):
            self.members = heard(self.members, cmd.device, cmd.at)
        else:
            getattr(log, cmd.level)(cmd.event, **cmd.fields)

    def gather(
        self,
        kind: type[Message],
        devices: list[DeviceId],
        epoch: int,
        round_no: int,
        timeout_s: float,
        watchdog_s: float | None = None,
    ) -> dict[DeviceId, Any]:
        """Wait for one `kind` reply of (epoch, round) from each of `devices`, outside a job.

        The rules are `core.apply`'s, fed by `events`, exactly as a job's
        steps are (`driver`): a device whose heartbeats are overdue is probed;
        one that leaves the probe unanswered is lost; with `watchdog_s`, one
        that heartbeats without progress for that long is lost as hung.

        Raises:
            DeviceLost: Devices of `devices` are dead or hung.
            JobFailed: A device reported an error, or the replies took over `timeout_s`.

        """
        s = self.settings
        wait = begin(
            kind,
            devices,
            epoch,
            round_no,
            time.monotonic(),
            timeout_s,
            s.heartbeat_s * s.heartbeat_misses,
            s.probe_timeout_s,
            watchdog_s,
            self.members,
            self.probes,
            self._next_nonce,
        )
        self.collecting = True
        try:
            while not wait.done:
                for event in self.events():
                    wait, commands = apply(wait, event, time.monotonic())
                    self.probes, self._next_nonce = wait.probes, wait.next_nonce
                    for cmd in commands:
                        if isinstance(cmd, Lost):
                            raise DeviceLost(cmd.devices, cmd.reason)
                        if isinstance(cmd, Fail):
                            raise JobFailed(cmd.reason)
                        if isinstance(cmd, Complete):
                            return dict(cmd.replies)
                        self.carry_out(cmd)
            return {}
        finally:
            self.collecting = False

    def request_plan(self, req: PlanRequest, timeout_s: float) -> Plan:
        """Ask the planner service for a plan for job `req.job_id`, and record it."""
        plan = self.request_scored_plan(req, timeout_s)[0]
        doc = plan.model_dump(mode="json")
        self.durable("storing the plan", lambda: self.store.put_json(doc, "plan", req.job_id))
        return plan

    def request_scored_plan(self, req: PlanRequest, timeout_s: float) -> tuple[Plan, float]:
        """`request_plan`, and the planner's prediction of `req.current` (0: none)."""
        deadline = time.monotonic() + timeout_s
        while PLANNER not in self.services:
            if time.monotonic() > deadline:
                raise JobFailed(
                    f"no planner service joined within {timeout_s:g} s (start asteroid-planner "
                    f"with --coordinator {self.endpoint})"
                )
            if self.running:
                self.check_cancelled(self.running)
            self.pump(0.1)
        reply: PlanReply = self.request(
            PLANNER,
            req,
            lambda m: isinstance(m, PlanReply) and m.job_id == req.job_id,
            max(0.0, deadline - time.monotonic()),
            what="plan",
        )
        if not reply.ok or reply.plan is None:
            raise PlanError(f"planner {req.planner!r} failed: {reply.error or 'no plan sent'}")
        return reply.plan, reply.current_round_s

    # --- jobs -------------------------------------------------------------------

    def run_job(
        self, job: JobSpec, plan: Plan | None = None, resume: bool = False, replace: bool = False
    ) -> JobSummary:
        """Run `job` to its last round (with `plan`, or profiled and planned); raises.

        With `resume`, go on from the last round an earlier coordinator committed,
        on its plan, where the workers still hold it (a restarted coordinator loses
        nothing), else from the job's newest committed checkpoint (possibly written
        under another plan): workers are re-assigned, not restarted. A job
        id that already has state is refused unless `resume` (keep it) or `replace`
        (delete it first) says what to do with it: starting a job never deletes
        another run's checkpoints by itself.
        """
        checked = check_job(job, self.settings.model_modules, probe_limits(self.settings))
        committed = 0

        def admit_job() -> None:
            nonlocal committed
            if resume:
                self._check_resumable(job.job_id, checked.rounds)
                # the rounds an earlier coordinator committed: its workers may still hold them
                committed = int(self.store.get_fields("job", job.job_id).get("round", 0) or 0)
            else:
                self._check_fresh(job.job_id, replace, "--replace")
            self.register(checked, forget_old=replace and not resume)

        self.durable(f"registering job {job.job_id}", admit_job)
        return self._run(checked, plan, resume, committed)

    def _run(
        self, checked: CheckedJob, plan: Plan | None, resume: bool, committed: int
    ) -> JobSummary:
        """Run a registered job: as one home of a federation if it says so, else plainly."""
        if checked.spec.federation is not None:
            return FederatedRun(self, checked).run(plan)
        return JobRun(self, checked).run(plan, resume, committed)

    def _existing(self, jid: str) -> str | None:
        """What Redis already holds for job id `jid` (its state, or its checkpoints), else None."""
        state = self.store.get_fields("job", jid).get("state")
        if state:
            return str(state)
        if latest_round(self.store, jid) is not None:
            return "checkpointed"
        if self.store.get_json("jobspec", jid) is not None:
            return "recorded"
        return None

    def _check_fresh(self, jid: str, replace: bool, how: str) -> None:
        """Refuse to reuse job id `jid` when it has state, unless the operator said `replace`."""
        state = self._existing(jid)
        if state and not replace:
            raise ConfigError(
                f"job_id: job {jid} exists ({state}); pick another job_id, or {how} to "
                "delete its checkpoints and metrics and start afresh"
            )

    def _check_resumable(self, jid: str, total: int) -> None:
        """Refuse to resume a job whose newest checkpoint is already its last round.

        Refused like any invalid job, before it is registered or waits for
        workers, so that its record (finished, say) stays as it was.
        """
        done = latest_round(self.store, jid)
        if done is not None and done >= total:
            raise ConfigError(
                f"resume: job {jid} has {total} rounds and already a checkpoint of round "
                f"{done}; nothing is left to run"
            )

    def serve(self, stop_after: str | None = None) -> JobSummary | None:
        """Run submitted jobs one after another until interrupted.

        With `stop_after`, return once that job has ended (its summary, or None
        if it did not finish).
        """
        while True:
            self.pump(0.2)
            if not self.queue:
                continue
            job = self.queue.popleft()
            summary = None
            try:
                if isinstance(job, ServeSpec):
                    ServeRun(self, job).run()
                else:
                    summary = self._run(job, None, False, 0)
            except AsteroidError as exc:
                log.error("job ended", job=job.job_id, error=str(exc))
            except Exception as exc:  # one job's unforeseen error ends that job, not the service
                log.exception("job crashed", job=job.job_id)
                self.write_soon(
                    f"job {job.job_id} failed",
                    partial(
                        self.write_state,
                        job.job_id,
                        "failed",
                        error=f"job {job.job_id} "
                        f"crashed in the coordinator: {mask_text(repr(exc))}",
                    ),
                )
            if stop_after == job.job_id:
                return summary

    def submit(self, job: JobSpec, replace: bool = False) -> None:
        """Check `job` and queue it; ConfigError says what is wrong and nothing starts."""
        checked = check_job(job, self.settings.model_modules, probe_limits(self.settings))
        state = self.store.get_fields("job", job.job_id).get("state")
        if state in ACTIVE or any(q.job_id == job.job_id for q in self.queue):
            raise ConfigError(f"job_id: job {job.job_id} is already {state or 'queued'}")
        self._check_fresh(job.job_id, replace, "submit with --replace")
        self.register(checked, forget_old=replace)
        self.queue.append(checked)

    def write_state(self, jid: str, state: str, **extra: Any) -> None:
        """Write a job's state: its hash and its events stream."""
        self.store.set_fields({"state": state, "updated": time.time(), **extra}, "job", jid)
        self.store.append("events", jid, {"event": state, **extra})

    def register(self, checked: CheckedJob, forget_old: bool = False) -> None:
        """Record the job as submitted; with `forget_old`, delete an earlier run of this id.

        Only an operator's explicit replace sets `forget_old`; otherwise an earlier
        run's checkpoints, metrics and events stay (a resumed job continues from
        them, and a new id has none).
        """
        job = checked.spec
        jid = check_job_id(job.job_id, "the job spec")  # it names keys to delete below
        if forget_old:
            parts = ("job", "events", "metrics", "plan", "cluster")
            self.store.r.delete(*(self.store.key(part, jid) for part in parts))
            self.store.delete_prefix("ckpt", jid, "")
        self.store.put_json(job.model_dump(mode="json"), "jobspec", jid)
        self.store.set_fields(
            {
                "state": "submitted",
                "submitted": time.time(),
                "total_rounds": checked.rounds,
                "round": 0,
            },
            "job",
            jid,
        )
        self.store.r.zadd(self.store.key("jobs"), {jid: time.time()})
        self.store.append("events", jid, {"event": "submitted"})

    def _client(self, peer: str, msg: SubmitJob | CancelJob | DrainDevice) -> None:
        """Answer a person's request (through the CLI) with a JobReply."""
        if isinstance(msg, SubmitJob):
            self._on_submit(peer, msg)
        elif isinstance(msg, CancelJob):
            self._on_cancel(peer, msg)
        else:
            self._on_drain(peer, msg)

    def _on_drain(self, peer: str, msg: DrainDevice) -> None:
        """Queue a drain for the running job, if the device is one of its plan's."""
        jid = self.running or ""
        if not self.running or msg.target not in self.assigned:
            error = f"device {msg.target!r} runs no part of a job here"
            if self.running:
                error += f" (job {jid} runs on {sorted(self.assigned)})"
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=error))
            return
        self.drains[msg.target] = msg.reason
        log.info("drain requested", device=msg.target, by=peer)
        self.send(DeviceId(peer), JobReply(job_id=jid, ok=True))

    def _refuse_request(self, exc: ProtocolError) -> None:
        """Answer an undecodable SubmitJob or CancelJob so that its sender learns why.

        A job spec that breaks a bound (a job_id outside the pattern, num_classes
        beyond the limit) fails validation while the message is decoded; the
        reason names the field. Other bad messages are only dropped.
        """
        if not exc.route or exc.kind not in _CLIENT_REQUESTS:
            return
        self._remember_route(exc.sender, exc.route)
        self.send(DeviceId(exc.sender), JobReply(job_id="", ok=False, error=exc.reason))

    def _on_submit(self, peer: str, msg: SubmitJob) -> None:
        jid = msg.job.job_id
        try:
            self.submit(msg.job, msg.replace)
        except ConfigError as exc:
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=str(exc)))
            return
        except OUTAGE as exc:
            error = (
                f"Redis at {self.store.where} is unreachable ({mask_text(str(exc))}): nothing "
                f"was queued; submit job {jid} again once it is back"
            )
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=error))
            return
        except Exception as exc:  # a job must not take the coordinator down; say what broke
            log.exception("job check failed", job=jid, by=peer)
            error = f"job {jid} from {peer} cannot be checked: {exc!r}"
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=error))
            return
        log.info("job submitted", job=jid, by=peer)
        self.send(DeviceId(peer), JobReply(job_id=jid, ok=True))

    def _on_serve(self, peer: str, msg: ServeModel) -> None:
        """Queue a serving job, recorded like a training job (`kind: serve`)."""
        jid = msg.spec.serve_id
        try:
            state = self.store.get_fields("job", jid).get("state")
            if state in ACTIVE or any(q.job_id == jid for q in self.queue):
                raise ConfigError(f"serve_id: job {jid} is already {state or 'queued'}")
            self.store.put_json(msg.spec.model_dump(mode="json"), "jobspec", jid)
            self.store.set_fields(
                {"state": "submitted", "submitted": time.time(), "kind": "serve"}, "job", jid
            )
            self.store.r.zadd(self.store.key("jobs"), {jid: time.time()})
        except ConfigError as exc:
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=str(exc)))
            return
        except OUTAGE as exc:
            error = f"Redis at {self.store.where} is unreachable ({mask_text(str(exc))})"
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=error))
            return
        except REFUSED as exc:
            error = str(self.store.refusal(exc, f"recording serving job {jid}"))
            self.send(DeviceId(peer), JobReply(job_id=jid, ok=False, error=error))
            return
        self.queue.append(msg.spec)
        log.info("serving job submitted", job=jid, by=peer)
        self.send(DeviceId(peer), JobReply(job_id=jid, ok=True))

    def _on_infer(self, peer: str, msg: InferRequest) -> None:
        """Queue a request for the running serving job; refuse it at once if it cannot wait."""
        req = PendingRequest(DeviceId(peer), msg, time.monotonic())
        if self.running != msg.serve_id:
            error = f"no serving job {msg.serve_id} is running here (running: {self.running})"
        elif (why := self.infer_queue.offer(req.owner, req)) is not None:
            error = f"{why} (serving job {msg.serve_id})"
        else:
            return
        reply = InferReply(serve_id=msg.serve_id, request=0, ok=False, error=error)
        self.send(DeviceId(peer), reply)

    def _on_cancel(self, peer: str, msg: CancelJob) -> None:
        jid = msg.job_id  # matched the job-id pattern when the message was decoded
        queued = [q for q in self.queue if q.job_id == jid]
        if queued:
            self.queue = deque(q for q in self.queue if q.job_id != jid)
            self.write_soon(
                f"job {jid} cancelled",
                partial(self.write_state, jid, "cancelled", reason=msg.reason),
            )
        elif jid in (self.running, self.federated):
            self.cancelled[jid] = msg.reason
            if jid == self.federated and self.running:  # the piece under way stops too
                self.cancelled[self.running] = msg.reason
        else:
            try:
                state = self.store.get_fields("job", jid).get("state", "unknown")
            except OUTAGE:
                state = "unknown while Redis is unreachable"
            self.send(
                DeviceId(peer),
                JobReply(
                    job_id=jid, ok=False, error=f"job {jid} is not queued or running ({state})"
                ),
            )
            return
        log.info("job cancel requested", job=jid, by=peer)
        self.send(DeviceId(peer), JobReply(job_id=jid, ok=True))

    def check_cancelled(self, jid: str) -> None:
        """Raise JobCancelled if someone cancelled job `jid`."""
        reason = self.cancelled.pop(jid, None)
        if reason is not None:
            raise JobCancelled(reason)

    def shutdown_workers(self, reason: str) -> None:
        """Tell every known worker to exit."""
        for d in self.members:
            self.send(d, Shutdown(reason=reason))
        self.pump(0.2)

    def close(self) -> None:
        """Release sockets and the Redis connection."""
        self.sock.close(0)
        self.ctx.term()
        self.store.close()
