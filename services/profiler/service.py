"""`asteroid-profiler --serve`: profiles on request, on the coordinator's control plane.

The profiler is a DEALER like every service, with identity
``profiler-<host>-<pid>`` because each device runs its own. It announces itself
with ServiceHello and answers each ProfileRequest with a ProfileReply: refused
(``mine=False``) when this device is not the one the request describes, so that
the coordinator asks another profiler; served at once when Redis already holds
the profile; else measured and stored where the one-shot command stores it.

A measurement takes tens of seconds, so it runs on a thread of its own while the
main thread keeps the socket: hellos keep going out (the coordinator must not
take a busy profiler for a dead one), requests that need no measurement are
answered at once, and a stop is noticed between two layer measurements.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from socket import gethostname
from typing import Any

import redis
import torch
import zmq

from common.accelerator import accelerator_budget, describe_accelerator, full_precision
from common.codec import Limits, encode, recv_message
from common.curve import service_keys
from common.device import device_fingerprint, memory_budget
from common.errors import AsteroidError, ProtocolError
from common.logging import get_logger
from common.messages import ProfileReply, ProfileRequest, ServiceHello
from common.model_key import model_key
from common.settings import ProfilerSettings
from common.sockets import connect_dealer, poll_in
from common.store import Store
from services.profiler.cache import load_reusable, profile_key, save
from services.profiler.layers import ProgressFn, Step, profile_model
from services.profiler.split import with_device_split_gain

__all__ = ["ProfilerService", "refusal", "service_identity"]

log = get_logger(__name__)

POLL_S = 0.1
"""Longest sleep of either thread: bounds how late a finished profile is sent and a stop seen."""

JOIN_S = 5.0
"""Longest wait at shutdown for a measurement to notice the stop (one layer's runs)."""


def service_identity() -> str:
    """The routing identity of this profiler: host and pid, as emulated devices share a host."""
    return f"profiler-{gethostname()}-{os.getpid()}"


def refusal(req: ProfileRequest, mine: str) -> ProfileReply | None:
    """The refusal of a request for another device than `mine`, None when it is for this one.

    A profile must come from the kind of device the worker that uses it runs on.
    """
    if mine == req.fingerprint:
        return None
    return ProfileReply(
        job_id=req.job_id,
        fingerprint=req.fingerprint,
        ok=False,
        mine=False,
        error=f"this profiler's device is {mine}, not {req.fingerprint}",
    )


def _error(req: ProfileRequest, error: str) -> ProfileReply:
    return ProfileReply(job_id=req.job_id, fingerprint=req.fingerprint, ok=False, error=error)


class _Stopped(BaseException):
    """Ends a measurement when the service stops: control flow, not an error to report."""


class ProfilerService:
    """The profiler's control-plane loop (main thread) and its measuring thread."""

    def __init__(self, settings: ProfilerSettings) -> None:
        """Connect to the coordinator.

        Raises:
            ConfigError: `--keys` lacks a key this service needs.
            zmq.ZMQError: The coordinator's address is invalid.

        """
        self.settings = settings
        self.accelerator = describe_accelerator(settings.accelerator)
        """Where layers are measured; part of the fingerprint requests must name."""
        full_precision(self.accelerator)  # measure what a worker computes
        # with keys: the one service secret in the key dir, one session of it per process;
        # loaded before anything that needs closing
        keys, server_key = service_keys(settings.keys)
        self.identity = f"{keys.name}/{service_identity()}" if keys else service_identity()
        self.limits = Limits(settings.max_header_bytes, settings.max_tensor_bytes)
        self.ctx: zmq.Context[Any] = zmq.Context()
        try:
            self.sock = connect_dealer(
                self.ctx, settings.coordinator, self.identity, keys=keys, server_key=server_key
            )
        except zmq.ZMQError:
            self.ctx.destroy(linger=0)  # also closes the socket the failed connect left open
            raise
        self.store = Store(settings.redis_url, settings.cluster)
        self.stopping = threading.Event()
        self._todo: queue.Queue[ProfileRequest] = queue.Queue()
        self._done: queue.Queue[ProfileReply] = queue.Queue()
        self._measurer = threading.Thread(
            target=self._measure_loop, name="profiler-measure", daemon=True
        )

    def serve(self) -> None:
        """Announce, answer requests, until `stopping` is set; then close everything.

        Raises:
            StoreError: Redis does not answer at start (profiles could go nowhere).

        """
        try:
            self.store.ping()
            self._measurer.start()
            log.info("profiler service ready", coordinator=self.settings.coordinator)
            next_hello = 0.0
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_hello:
                    hello = ServiceHello(service=self.identity, pid=os.getpid(), host=gethostname())
                    self._send(hello)
                    next_hello = now + self.settings.heartbeat_s
                self._send_finished()
                if poll_in(self.sock, min(POLL_S, self.settings.heartbeat_s)):
                    self._receive()
        finally:
            self.stopping.set()
            if self._measurer.is_alive():
                self._measurer.join(JOIN_S)
                if self._measurer.is_alive():
                    log.warning("a measurement is still running; leaving it behind")
            self.sock.close(0)
            self.ctx.term()
            self.store.close()

    # --- main thread: the socket ------------------------------------------------

    def _send(self, msg: ProfileReply | ServiceHello) -> None:
        try:
            self.sock.send_multipart(encode(msg, self.identity))
        except zmq.Again:
            log.warning("coordinator does not take messages; dropped one", type=msg.type)

    def _send_finished(self) -> None:
        while True:
            try:
                reply = self._done.get_nowait()
            except queue.Empty:
                return
            self._send(reply)

    def _receive(self) -> None:
        try:
            _, env = recv_message(self.sock, self.limits)
        except ProtocolError as exc:
            log.warning("dropped bad message", peer=exc.sender, reason=exc.reason)
            return
        if not isinstance(env.msg, ProfileRequest):
            log.warning("unexpected message", type=env.msg.type, sender=env.sender)
            return
        req = env.msg
        reply = self._answer_without_measuring(req)
        if reply is not None:
            self._send(reply)
            return
        log.info("measurement queued", job=req.job_id, device=req.fingerprint)
        self._todo.put(req)

    def _answer_without_measuring(self, req: ProfileRequest) -> ProfileReply | None:
        """A refusal, a cached profile, or a Redis failure; None when a measurement is due."""
        here = device_fingerprint(req.threads, req.memory_budget, accelerator=self.accelerator)
        refused = refusal(req, here)
        if refused is not None:
            log.info("request for another device", job=req.job_id, error=refused.error)
            return refused
        try:
            prof = load_reusable(self.store, model_key(req.model), req.fingerprint, req.batch_sizes)
        except (AsteroidError, redis.RedisError) as exc:
            log.warning("cannot read stored profiles", job=req.job_id, error=str(exc))
            return _error(req, str(exc))
        if prof is None:
            return None
        log.info("profile reused from Redis", job=req.job_id, model=prof.model, device=prof.device)
        key = profile_key(prof.model, prof.device)
        return ProfileReply(job_id=req.job_id, fingerprint=req.fingerprint, ok=True, key=key)

    # --- measuring thread -------------------------------------------------------

    def _measure_loop(self) -> None:
        """Measure queued requests one at a time (the device has one set of cores)."""
        while not self.stopping.is_set():
            try:
                req = self._todo.get(timeout=POLL_S)
            except queue.Empty:
                continue
            # asked again while queued: an earlier measurement may have stored it since
            reply = self._answer_without_measuring(req)
            try:
                self._done.put(reply if reply is not None else self._measure(req))
            except _Stopped:
                return

    def _measure(self, req: ProfileRequest) -> ProfileReply:
        """Profile on as many threads as the worker uses, store, and say where."""
        key = model_key(req.model)
        budget = accelerator_budget(
            self.accelerator, memory_budget(req.memory_budget), req.memory_budget
        )
        before = torch.get_num_threads()
        started = time.perf_counter()
        log.info(
            "profiling", job=req.job_id, model=key, device=req.fingerprint, threads=req.threads
        )
        torch.set_num_threads(req.threads)
        try:
            prof = profile_model(
                req.model,
                req.batch_sizes or None,
                repeats=self.settings.repeats,
                warmup=self.settings.warmup,
                memory_budget=budget,
                progress=self._progress(req.job_id, started),
                optimizer=req.optimizer,
                max_batch=self.settings.max_batch,
                device=req.fingerprint,
                allowed_modules=self.settings.model_modules,
                accelerator=self.accelerator,
            )
            prof = with_device_split_gain(
                prof, req.model, self.settings.model_modules, accelerator=self.accelerator
            )
            stored = save(self.store, prof)
        except (AsteroidError, redis.RedisError) as exc:
            log.warning("profiling failed", job=req.job_id, model=key, error=str(exc))
            return _error(req, str(exc))
        except Exception as exc:
            # torch reports running out of memory as a RuntimeError from anywhere in a
            # model, and custom model code raises anything: the coordinator still needs
            # an answer, and this service the next request
            log.exception("profiling failed unexpectedly", job=req.job_id, model=key)
            return _error(req, f"{type(exc).__name__}: {exc}")
        finally:
            torch.set_num_threads(before)
        seconds = time.perf_counter() - started
        log.info(
            "profile measured and stored",
            job=req.job_id,
            model=key,
            batch_sizes=prof.batch_sizes,
            elapsed_s=round(seconds, 2),
            redis_key=self.store.key("profile", stored),
        )
        return ProfileReply(
            job_id=req.job_id, fingerprint=req.fingerprint, ok=True, key=stored, seconds=seconds
        )

    def _progress(self, job: str, started: float) -> ProgressFn:
        """Log each batch size measured, and end the measurement once stopping."""

        def progress(step: Step) -> None:
            if self.stopping.is_set():
                raise _Stopped
            if step.layer == step.layers - 1:
                elapsed = round(time.perf_counter() - started, 2)
                log.info("batch size measured", job=job, batch=step.batch, elapsed_s=elapsed)

        return progress
