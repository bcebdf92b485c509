"""The profiler service against a real ROUTER standing in for the coordinator."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from socket import gethostname
from typing import Any, TypeVar

import msgpack
import pytest
import torch
import zmq

import services.profiler.service as service_module
from common.codec import Limits, encode, peer_of_route, recv_message, send_message
from common.device import device_fingerprint
from common.messages import (
    PROTOCOL_VERSION,
    Message,
    PlanReply,
    ProfileReply,
    ProfileRequest,
    ServiceHello,
)
from common.model_key import model_key
from common.profile import Profile
from common.settings import ProfilerSettings
from common.sockets import bind_router, poll_in
from common.store import Store
from common.zoo import ModelSpec
from services.profiler.layers import Step
from services.profiler.service import ProfilerService

M = TypeVar("M", bound=Message)
MLP = ModelSpec(name="mlp")


@dataclass
class Coordinator:
    """The coordinator's side of the control plane, reduced to what a profiler sees."""

    router: zmq.Socket[Any]
    route: bytes = b""

    def next(self, kind: type[M], timeout_s: float = 60.0, job: str | None = None) -> M:
        """The next message of `kind` (and `job`, for replies), skipping everything else."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not poll_in(self.router, left):
                break
            _, env = recv_message(self.router, Limits(), routed=True)
            self.route = env.route
            if isinstance(env.msg, kind) and (job is None or getattr(env.msg, "job_id", "") == job):
                return env.msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def ask(self, req: ProfileRequest, timeout_s: float = 120.0) -> ProfileReply:
        send_message(self.router, req, "coordinator", route=self.route)
        return self.next(ProfileReply, timeout_s, job=req.job_id)

    def send_raw(self, *frames: bytes) -> None:
        self.router.send_multipart([self.route, *frames])


@dataclass
class Running:
    service: ProfilerService
    thread: threading.Thread
    coordinator: Coordinator
    store: Store

    def stop(self) -> None:
        self.service.stopping.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the service did not stop"


@pytest.fixture
def running(redis_url: str, cluster_name: str) -> Iterator[Running]:
    """A profiler service on a thread, connected to a ROUTER; its first hello has arrived."""
    ctx: zmq.Context[Any] = zmq.Context()
    router, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", Limits())
    settings = ProfilerSettings(
        coordinator=endpoint,
        redis_url=redis_url,
        cluster=cluster_name,
        heartbeat_s=0.2,
        repeats=1,
        warmup=0,
    )
    service = ProfilerService(settings)
    thread = threading.Thread(target=service.serve, name="profiler-service", daemon=True)
    thread.start()
    store = Store(redis_url, cluster_name)
    run = Running(service, thread, Coordinator(router), store)
    try:
        run.coordinator.next(ServiceHello)
        yield run
    finally:
        run.stop()
        store.close()
        router.close(0)
        ctx.term()


def request(job: str, spec: ModelSpec = MLP, threads: int = 1, **fields: Any) -> ProfileRequest:
    fields.setdefault("fingerprint", device_fingerprint(threads))
    return ProfileRequest(job_id=job, model=spec, threads=threads, **fields)


def test_hello_names_this_profiler(running):
    hello = running.coordinator.next(ServiceHello)
    assert hello.service == running.service.identity == peer_of_route(running.coordinator.route)
    assert hello.service == f"profiler-{gethostname()}-{os.getpid()}"
    assert hello.pid == os.getpid() and hello.host == gethostname()


def test_request_for_another_device_is_refused(running):
    reply = running.coordinator.ask(request("j1", fingerprint="other-device"))
    assert not reply.ok and not reply.mine
    assert reply.fingerprint == "other-device"
    assert reply.error == f"this profiler's device is {device_fingerprint(1)}, not other-device"
    assert running.store.get_fields("profiles", model_key(MLP)) == {}


def test_measures_stores_and_then_reuses(running):
    fp = device_fingerprint(1)
    first = running.coordinator.ask(request("j1", batch_sizes=[1, 2]))
    assert first.ok and first.mine, first.error
    assert first.key == f"{model_key(MLP)}:{fp}" and first.fingerprint == fp
    assert first.seconds > 0
    # where the one-shot command stores it: the profile, and the model's device index
    stored = Profile.model_validate(running.store.get_json("profile", first.key))
    assert stored.batch_sizes == [1, 2] and stored.device == fp
    assert stored.model == model_key(MLP)
    assert fp in running.store.get_fields("profiles", model_key(MLP))

    # a subset of the measured batch sizes is served from Redis, not measured again
    again = running.coordinator.ask(request("j2", batch_sizes=[2]))
    assert again.ok and again.key == first.key
    reread = Profile.model_validate(running.store.get_json("profile", first.key))
    assert reread.created == stored.created


def test_bad_model_is_an_error_reply_and_the_service_goes_on(running):
    reply = running.coordinator.ask(request("bad", ModelSpec(name="nope"), batch_sizes=[1]))
    assert not reply.ok and reply.mine
    assert "unknown model name 'nope'" in reply.error
    good = running.coordinator.ask(request("good", batch_sizes=[1]))
    assert good.ok, good.error


def test_unreadable_messages_are_dropped(running):
    body = {"type": "profile_request", "job_id": "x"}  # required fields missing
    header = {"v": PROTOCOL_VERSION, "sender": "c", "id": 1, "t": 0.0, "tensors": []}
    coord = running.coordinator
    coord.send_raw(b"garbage")
    coord.send_raw(msgpack.packb([1, 2, 3]))
    coord.send_raw(msgpack.packb({**header, "v": 99, "msg": body}))
    coord.send_raw(msgpack.packb({**header, "msg": body}))
    coord.send_raw(*encode(request("extra"), "c"), b"an unannounced frame")
    # a valid message of the wrong kind is ignored as well
    send_message(coord.router, PlanReply(job_id="p", ok=True), "c", route=coord.route)
    reply = coord.ask(request("after", fingerprint="other-device"))
    assert reply.job_id == "after" and not reply.mine
    assert running.thread.is_alive()


@pytest.fixture
def held_measurement(monkeypatch):
    """Measurements wait for `release`, recording the torch threads they run with."""
    started, release = threading.Event(), threading.Event()
    threads: list[int] = []
    real = service_module.profile_model

    def held(*args: Any, **kwargs: Any) -> Profile:
        threads.append(torch.get_num_threads())
        started.set()
        assert release.wait(60), "the test never released the measurement"
        return real(*args, **kwargs)

    monkeypatch.setattr(service_module, "profile_model", held)
    return started, release, threads


def test_hellos_and_answers_go_on_while_measuring(running, held_measurement):
    started, release, threads = held_measurement
    coord = running.coordinator
    send_message(coord.router, request("slow", threads=2, batch_sizes=[1]), "c", route=coord.route)
    assert started.wait(60)
    # a request needing no measurement does not wait behind the one running
    assert not coord.ask(request("other", fingerprint="other-device")).mine
    # messages from one peer arrive in order: these hellos left after that reply,
    # while the measurement was still held
    for _ in range(2):
        coord.next(ServiceHello)
    release.set()
    reply = coord.next(ProfileReply, 120, job="slow")
    assert reply.ok, reply.error
    assert reply.key.endswith(device_fingerprint(2))
    assert threads == [2]  # the worker's thread count, which its fingerprint names


def test_a_stop_ends_a_running_measurement(running, monkeypatch):
    started, stopped = threading.Event(), threading.Event()

    def endless(*_: Any, progress: Any = None, **__: Any) -> Profile:
        started.set()
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                progress(Step(0, 1, 0, 1, 1))
                time.sleep(0.01)
        except BaseException:
            stopped.set()
            raise
        raise AssertionError("the measurement was never told to stop")

    monkeypatch.setattr(service_module, "profile_model", endless)
    coord = running.coordinator
    send_message(coord.router, request("long", batch_sizes=[1]), "c", route=coord.route)
    assert started.wait(60)
    running.stop()
    assert stopped.is_set()
