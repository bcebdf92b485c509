"""`asteroid-federation`: the server of Eco-FL-style federated learning across homes.

A ROUTER that homes' coordinators reach (over CURVE beyond loopback: the federation's
key set holds its pair as the "coordinator" and one "worker" pair per home, named
``home-N``, so a home can only speak as itself). The rules of rounds, groups and
merging are `services.federation.server.Federation`'s; this module is the shell around it:
sockets, the checks every incoming model passes, scoring each global model on held-out
data, and Redis (``fl:<id>`` hash: version, state; ``fl-model:<id>`` the newest global
model; ``fl-metrics:<id>`` a stream with one entry per round that ended).

A bad message is logged with the sender and answered with a refusal; it never stops
the service or changes the global model.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import zmq

from common.codec import Envelope, Limits, recv_message, send_message
from common.curve import is_loopback, load_keys
from common.errors import ConfigError, ProtocolError
from common.federation_messages import (
    FederatedModel,
    FederationReply,
    FetchModel,
    HomeUpdate,
    JoinFederation,
)
from common.fl.data import DIGIT_CLASSES, TensorData, load_digits_split
from common.fl.spec import FederationSpec
from common.fl.wire import state_frame, state_from_frame
from common.inbound import MemoryGuard
from common.logging import get_logger
from common.messages import Message
from common.records.federation import count_start, forget_federation
from common.settings import FederationSettings
from common.sockets import bind_router, reset_router
from common.store import Store
from common.zoo import build_model
from services.federation.server import Federation, RoundEnd, StaleUpdate
from services.federation.strategies import strategy_for

__all__ = ["FederationService", "home_of"]

log = get_logger(__name__)
WAIT_S = 0.2
"""How long a home told to wait lets pass before asking again."""
ROUND_EPOCH_BITS = 32
"""Round ids of the n-th start of a federation begin at (n - 1) << 32."""


def home_of(user: str) -> int | None:
    """The home id a CURVE user "worker:home-N" speaks for (None: not a home's key)."""
    role, _, name = user.partition(":")
    prefix = "home-"
    if role != "worker" or not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])


class FederationService:
    """The federation's socket loop around a `Federation`."""

    def __init__(self, settings: FederationSettings, spec: FederationSpec) -> None:
        """Build the initial global model and bind.

        Raises:
            ConfigError: Bound beyond loopback without keys, a bad key set, a model
                the zoo cannot build, or stored state that does not fit the spec.
            StoreError: Redis does not answer.
            zmq.ZMQError: The address cannot be bound.

        """
        self.settings, self.spec = settings, spec
        self.limits = Limits(settings.max_header_bytes, settings.max_tensor_bytes, max_tensors=1)
        keys = load_keys(settings.keys, "coordinator")
        if keys is None and not is_loopback(settings.bind):
            raise ConfigError(
                f"refusing to bind {settings.bind} without CURVE keys: anyone on that network "
                "could send model updates. Make the federation's key set with `asteroid keys "
                "init DIR --worker home-0 --worker home-1 ...` and pass --keys DIR"
            )
        model = build_model(spec.model, spec.seed, settings.model_modules)
        self.net = model.full()
        self.store = Store(settings.redis_url, settings.cluster)
        self.store.ping()  # one named error if Redis is away, before anything uses it
        fid = spec.federation_id
        if settings.replace:
            forget_federation(self.store, fid)
        starts = count_start(self.store, fid)
        self.federation = Federation(
            strategy_for(spec),
            self.net.state_dict(),
            spec.homes,
            spec.updates,
            spec.round_timeout_s,
            first_round=(starts - 1) << ROUND_EPOCH_BITS,
        )
        self.resumed = self._resume()
        self.held_out: TensorData | None = None
        if spec.eval_digits_seed is not None:
            split = load_digits_split(seed=spec.eval_digits_seed)
            self.held_out = TensorData(split.test_x, split.test_y, DIGIT_CLASSES)
            self.held_out.check_model(model, "the federation's held-out digits")
        self.ctx: zmq.Context[Any] = zmq.Context()
        try:
            self.sock, self.endpoint = bind_router(
                self.ctx, settings.bind, self.limits, keys, roles=("worker",)
            )
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.keyed = keys is not None
        self._keys = keys
        self.guard = MemoryGuard.above_now(settings.inbound_margin)
        """Resets the socket should a home's unfinished message outgrow the margin."""
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.told_done: set[int] = set()
        self.done_at: float | None = None

    def _resume(self) -> bool:
        """Continue from what an earlier run of this federation left in Redis, if anything.

        Raises:
            ConfigError: The stored state does not fit this spec (say, other homes);
                `--replace` starts afresh.

        """
        fid = self.spec.federation_id
        snapshot = self.store.get_fields("fl", fid).get("snapshot")
        blob = self.store.get_blob("fl-model", fid)
        if snapshot is None or blob is None:
            return False
        reference = self.net.state_dict()
        frame = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        try:
            state = state_from_frame([frame], reference, "the stored global model")
            self.federation.restore(snapshot, state)
        except ConfigError as exc:
            raise ConfigError(f"federation {fid}: {exc} (--replace starts it afresh)") from exc
        log.info("federation resumed", federation=fid, version=self.federation.version)
        return True

    # --- loop ----------------------------------------------------------------

    def serve(self) -> None:
        """Answer homes until stopped (or, with exit_when_done, until every home knows)."""
        fid = self.spec.federation_id
        if not self.resumed:
            self._publish(None, self.federation.version, self._score())
        log.info(
            "federation ready", federation=fid, bind=self.endpoint, strategy=self.spec.strategy
        )
        try:
            while not self.stopping.is_set():
                if self.guard.exceeded():
                    log.warning("reset the socket: the federation outgrew its memory limit")
                    self.sock = reset_router(self.sock, self.ctx, self.limits, self._keys)
                if self.sock.poll(100, zmq.POLLIN):
                    self._receive()
                for end in self.federation.expire(time.monotonic()):
                    self._ended(end)
                if self._finished():
                    break
        finally:
            self.sock.close(0)
            self.ctx.term()
            self.store.close()

    def _finished(self) -> bool:
        if not self.settings.exit_when_done or not self.federation.done:
            return False
        if self.done_at is None:
            self.done_at = time.monotonic()
        everyone = len(self.told_done) >= self.spec.homes
        return everyone or time.monotonic() - self.done_at > self.settings.done_grace_s

    def _receive(self) -> None:
        try:
            peer, env = recv_message(self.sock, self.limits, routed=True)
        except ProtocolError as exc:
            log.warning("refused bad message", peer=exc.sender, reason=exc.reason)
            if exc.kind in ("join_federation", "fetch_model", "home_update"):
                home = home_of(f"worker:{exc.sender}")
                refusal = self._reply(home or 0, False, f"bad {exc.kind}: {exc.reason}")
                if exc.route:
                    self._send(exc.route, refusal)
            return
        msg = env.msg
        if not isinstance(msg, JoinFederation | FetchModel | HomeUpdate):
            log.warning("unexpected message", peer=peer, type=msg.type)
            return
        route = env.route
        who = f"home {msg.home} ({peer})"
        try:
            self._check_sender(env, msg.home, msg.federation, who)
            if isinstance(msg, JoinFederation):
                self._join(route, msg)
            elif isinstance(msg, FetchModel):
                self._fetch(route, msg)
            else:
                self._update(route, msg, env.tensors, who)
        except ConfigError as exc:
            log.warning("refused", peer=peer, home=msg.home, type=msg.type, error=str(exc))
            stale = isinstance(exc, StaleUpdate)
            self._send(route, self._reply(msg.home, False, str(exc), stale=stale))

    def _check_sender(self, env: Envelope, home: int, federation: str, who: str) -> None:
        if federation != self.spec.federation_id:
            raise ConfigError(
                f"{who}: this is federation {self.spec.federation_id}, not {federation}"
            )
        if self.keyed and home_of(env.user) != home:
            raise ConfigError(f"{who}: its key ({env.user}) is not home {home}'s")

    # --- requests --------------------------------------------------------------

    def _join(self, route: bytes, msg: JoinFederation) -> None:
        if msg.model != self.spec.model:
            raise ConfigError(
                f"home {msg.home}: it trains {msg.model.name} {msg.model.options}, the "
                f"federation {self.spec.model.name} {self.spec.model.options}"
            )
        self.federation.join(msg.home, msg.num_samples, msg.histogram)
        self.store.set_fields(
            {"snapshot": self.federation.snapshot()}, "fl", self.spec.federation_id
        )
        log.info(
            "home joined",
            home=msg.home,
            samples=msg.num_samples,
            joined=len(self.federation.joined),
        )
        self._send(route, self._reply(msg.home, True))

    def _fetch(self, route: bytes, msg: FetchModel) -> None:
        task = self.federation.task(msg.home, time.monotonic())
        if task.status == "done":
            self.told_done.add(msg.home)
        reply = FederatedModel(
            federation=self.spec.federation_id,
            home=msg.home,
            status=task.status,
            round_id=task.round_id,
            version=task.version,
            wait_s=WAIT_S if task.status == "wait" else 0.0,
        )
        frames = [state_frame(task.state)] if task.state is not None else []
        self._send(route, reply, frames)

    def _update(self, route: bytes, msg: HomeUpdate, tensors: list[torch.Tensor], who: str) -> None:
        state = state_from_frame(tensors, self.federation.state, who)
        end = self.federation.submit(
            msg.home, msg.round_id, state, msg.num_samples, msg.latency_s, time.monotonic()
        )
        log.info(
            "home update",
            home=msg.home,
            round_id=msg.round_id,
            latency_s=round(msg.latency_s, 3),
            local_accuracy=msg.local_accuracy,
        )
        self._send(route, self._reply(msg.home, True))
        if end is not None:
            self._ended(end)

    # --- rounds ------------------------------------------------------------------

    def _ended(self, end: RoundEnd) -> None:
        groups = self.federation.groups
        for event in end.screened:
            log.warning(
                "home update screened",
                home=event.home,
                action=event.action,
                reason=event.reason,
                round_id=end.round_id,
            )
        if end.unheld is not None:
            log.warning(
                "eco-fl cannot hold its groups",
                homes=[h for h, _ in end.unheld.homes],
                latencies=[round(lat, 4) for _, lat in end.unheld.homes],
                rt_fraction=end.unheld.rt_fraction,
                needed_rt_fraction=round(end.unheld.needed, 4),
                detail=end.unheld.warning(),
            )
        log.info(
            "round ended",
            round_id=end.round_id,
            group=end.group,
            members=list(end.members),
            failed=list(end.failed),
            version=end.version,
            regroups=[(r.home, r.action, r.group) for r in end.regroups],
            groups=[list(g) for g in groups.groups] if groups else None,
        )
        self._publish(end, end.version, self._score())

    def _score(self) -> float:
        """Held-out accuracy of the global model (-1 without held-out data)."""
        if self.held_out is None:
            return -1.0
        self.net.load_state_dict(self.federation.state)
        self.net.eval()
        with torch.no_grad():
            guess = self.net(self.held_out.x).argmax(dim=1)
        return float((guess == self.held_out.y).float().mean())

    def _publish(self, end: RoundEnd | None, version: int, accuracy: float) -> None:
        fid, fed = self.spec.federation_id, self.federation
        groups = fed.groups
        entry: dict[str, Any] = {
            "time_s": time.monotonic() - self.started,
            "version": version,
            "accuracy": accuracy,
            "groups": [list(g) for g in groups.groups] if groups else [],
            "dropped": sorted(groups.dropped) if groups else [],
        }
        if end is not None:
            entry |= {
                "round_id": end.round_id,
                "group": end.group,
                "members": list(end.members),
                "latencies": [round(lat, 4) for lat in end.latencies],
                "failed": list(end.failed),
                "regroups": [[r.home, r.action, r.group] for r in end.regroups],
                "screened": [[e.home, e.action, e.reason] for e in end.screened],
            }
            if end.unheld is not None:
                entry["unheld"] = {
                    "homes": [h for h, _ in end.unheld.homes],
                    "latencies": [round(lat, 4) for _, lat in end.unheld.homes],
                    "rt_fraction": end.unheld.rt_fraction,
                    "needed_rt_fraction": round(end.unheld.needed, 4),
                    "warning": end.unheld.warning(),
                }
        self.store.put_blob(bytes(state_frame(fed.state).numpy()), "fl-model", fid)
        fields = {
            "state": "finished" if fed.done else "running",
            "version": version,
            "accuracy": accuracy,
            "homes": self.spec.homes,
            "snapshot": fed.snapshot(),
        }
        self.store.set_fields(fields, "fl", fid)
        self.store.append("fl-metrics", fid, entry)

    def _reply(
        self, home: int, ok: bool, error: str = "", *, stale: bool = False
    ) -> FederationReply:
        return FederationReply(
            federation=self.spec.federation_id,
            home=home,
            ok=ok,
            error=error[:2000],
            stale=stale,
            version=self.federation.version,
        )

    def _send(self, route: bytes, msg: Message, frames: list[torch.Tensor] | None = None) -> None:
        send_message(self.sock, msg, "federation", frames or [], route=route)
