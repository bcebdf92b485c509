"""`asteroid-worker`: one per device; joins the coordinator and runs its stage.

Main thread: commands from the coordinator (assign, run round, evaluate,
checkpoint, shutdown) and all torch compute. Side threads: control link
(heartbeats), receiver (task pool), dispatcher (sends), the bandwidth sink
peers measure their link to this device with, and the link prober that
measures this device's links when the coordinator asks (MeasureLinks). A failure inside a
command is reported to the coordinator as a WorkerError; the worker keeps
serving.
"""

from __future__ import annotations

import faulthandler
import functools
import hashlib
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import zmq
from torch import nn

from common.accelerator import accelerator_budget, describe_accelerator, full_precision
from common.bootstrap import Stop, run_service
from common.codec import Limits
from common.curve import load_keys
from common.device import (
    cpu_quota,
    device_fingerprint,
    training_budget,
    visible_cores,
)
from common.errors import AsteroidError, ConfigError, RoundAbortedError
from common.exit_codes import ExitCode
from common.ids import DeviceId
from common.inbound import MemoryGuard
from common.locate import CoordinatorUnreachable, with_redis
from common.logging import bind_global, get_logger
from common.memory import keep_freed_memory
from common.messages import (
    MAX_PEER_WAIT_S,
    Assign,
    Assigned,
    CheckpointSaved,
    Collect,
    EvalDone,
    Handover,
    Heartbeat,
    LayerState,
    MeasureLinks,
    PeerDown,
    ReplicaSaved,
    RoundDone,
    RunEval,
    RunRound,
    SaveCheckpoint,
    Shutdown,
    WorkerError,
)
from common.serving_messages import LoadShard, ProfileBlocks, RunInference
from common.settings import WorkerSettings
from common.store import Store
from common.version import VERSION
from common.zoo import ModelSpec, ZooModel, build_model
from services.worker.addressing import data_hosts
from services.worker.bandwidth import BandwidthSink
from services.worker.control import ControlLink
from services.worker.faults import FailAt
from services.worker.holdings import HeldLayer, Holdings, ReplicaSource
from services.worker.links import LinkProber
from services.worker.peer_watch import How, neighbours
from services.worker.pool import TaskPool
from services.worker.serving import Serving
from services.worker.stage import StageRunner, blob_tensor
from services.worker.transport import Dispatcher, Receiver

__all__ = ["Worker", "main"]

log = get_logger(__name__)

SLOW_CLOSE_S = 10.0
"""A shutdown longer than this dumps every thread's stack to the log (it should take < 1 s)."""


def default_threads(workers_per_host: int) -> int:
    """Cores per worker, so workers sharing a machine do not oversubscribe it."""
    return max(1, (os.cpu_count() or 1) // workers_per_host)


def _warm_up() -> None:
    """Pay torch's one-off lazy imports before joining.

    Optimizers pull in the compiler stack on first use; paying that here keeps
    the first assignment from being seconds late.
    """
    param = nn.Parameter(torch.zeros(1))
    torch.optim.SGD([param], lr=0.1).step()


class Worker:
    """A device's worker: wiring of sockets, threads and the stage runner."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        keys = load_keys(settings.keys, "worker", settings.device or None)
        self.device = DeviceId(
            keys.name if keys else settings.device or f"{socket.gethostname()}-{os.getpid()}"
        )
        self.limits = Limits(settings.max_header_bytes, settings.max_tensor_bytes)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pool = TaskPool(settings.pool_max_bytes)
        self.holdings = Holdings(settings.pool_max_bytes, self._replica_saved)
        bind, host = data_hosts(settings.data_host, settings.advertise_host, settings.coordinator)
        self.receiver = Receiver(
            self.ctx,
            f"tcp://{bind}:{settings.data_port}",
            self.limits,
            self.pool,
            keys,
            self.holdings,
        )
        self.data_addr = f"tcp://{host}:{self.receiver.endpoint.rsplit(':', 1)[1]}"
        # secured like the data socket, so a probe measures what tensors will see
        self.sink = BandwidthSink(
            self.ctx, f"tcp://{bind}:{settings.link_port}", self.limits, keys=keys
        )
        self.link_addr = f"tcp://{host}:{self.sink.endpoint.rsplit(':', 1)[1]}"
        self.dispatcher = Dispatcher(self.ctx, self.device, keys, report=self._link_changed)
        self.bulk = Dispatcher(self.ctx, self.device, keys, session="bulk")
        self.stopping = threading.Event()
        self.control = ControlLink(
            self.ctx,
            settings.coordinator,
            self.device,
            self.limits,
            settings.heartbeat_s,
            self._heartbeat,
            self.pool.abort,
            keys,
            # a new serving shard makes the request under way stale (the main thread runs it)
            on_command=lambda msg: self.serving.announce(msg),
        )
        self.pool.on_silent = self._silent
        self.prober = LinkProber(self.ctx, self.device, keys, self.control.send)
        self.accelerator = describe_accelerator(settings.accelerator)
        """What the stage computes on; a GPU's name and memory are in the fingerprint."""
        full_precision(self.accelerator)
        self.fingerprint = device_fingerprint(
            torch.get_num_threads(), settings.memory_budget, accelerator=self.accelerator
        )
        self.budget = settings.memory_budget
        self.runner: StageRunner | None = None
        self._zoo: tuple[str, ZooModel] | None = None
        """The job's model last built here, by its (model, seed) key."""
        self.state = "idle"
        self.fail_at = FailAt.parse(settings.fail_at)
        # The worker's own Redis URL and credentials (its per-role ACL user), never the
        # coordinator's: assignments name no Redis. redis-py connects on first use.
        self.store = Store(settings.redis_url, settings.cluster)
        self.serving = Serving(
            self.ctx,
            self.device,
            keys,
            settings.pool_max_bytes,
            settings.task_timeout_s,
            lambda: "the worker is stopping" if self.stopping.is_set() else None,
            self.store,
            self.accelerator.device,
        )
        self.receiver.tiles = self.serving.inbox

    def _heartbeat(self) -> Heartbeat:
        r = self.runner
        return Heartbeat(
            device=self.device,
            data_addr=self.data_addr,
            link_addr=self.link_addr,
            memory_budget=self.budget,
            fingerprint=self.fingerprint,
            threads=torch.get_num_threads(),
            host=socket.gethostname(),
            cores=visible_cores(),
            cpu_quota=cpu_quota() or 0.0,
            memory_configured=self.settings.memory_budget,
            pid=os.getpid(),
            epoch=r.epoch if r else 0,
            stage=r.p if r else -1,
            round=r.round if r else -1,
            state=self.state,
            progress=r.progress if r else 0,
            # loading a stage waits on Redis or on peers (each read bounded): not a hang
            waiting=self.state == "loading" or (r.waiting if r else False),
            version=VERSION,
        )

    def _link_changed(self, epoch: int, peer: str, how: How) -> None:
        """A neighbour's data connection closed or came back: evidence for the coordinator."""
        self.control.send(PeerDown(device=self.device, epoch=epoch, peer=DeviceId(peer), how=how))

    def _silent(self, epoch: int, peer: str, waited_s: float) -> None:
        """A neighbour's data is overdue (the Assign's peer_timeout_s): evidence too."""
        log.warning("neighbour silent", peer=peer, waited_s=round(waited_s, 3))
        self.control.send(
            PeerDown(
                device=self.device,
                epoch=epoch,
                peer=DeviceId(peer),
                how="silent",
                waited_s=min(waited_s, MAX_PEER_WAIT_S - 1),  # a wait is bounded far below
            )
        )

    def serve(self) -> None:
        """Run until told to shut down (or SIGTERM/SIGINT)."""
        _warm_up()
        # measured after torch is loaded: what is left is what training may use
        host = training_budget(self.settings.memory_budget)
        # a discrete GPU's budget is its free memory; a CPU's or a Jetson's is the host's
        self.budget = accelerator_budget(self.accelerator, host, self.settings.memory_budget)
        # what peers may make this process hold in host memory: its training (on the
        # host unless a discrete GPU holds it), the pool's parts, a margin
        guard = MemoryGuard.above_now(
            host + self.settings.pool_max_bytes + self.settings.inbound_margin
        )
        # either socket may be the one flooded: both are reset at each excess
        self.receiver.guard, self.sink.guard = guard.watch(), guard.watch()
        self.receiver.start()
        self.sink.start()
        self.dispatcher.start()
        self.bulk.start()
        self.serving.dispatcher.start()
        self.control.start()
        log.info(
            "worker started",
            data=self.data_addr,
            link=self.link_addr,
            coordinator=self.settings.coordinator,
            redis=self.store.where,
            version=VERSION,
            accelerator=self.accelerator.name,
            memory_budget=self.budget,
        )
        try:
            while not self.stopping.is_set():
                try:
                    env = self.control.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._handle(env.msg)
        finally:
            self.close()

    def _handle(self, msg: object) -> None:
        # an error reply names the epoch of the command that failed
        epoch = getattr(msg, "epoch", self.runner.epoch if self.runner else 0)
        try:
            if isinstance(msg, Assign):
                self._assign(msg)
            elif isinstance(msg, RunRound):
                self._run_round(msg)
            elif isinstance(msg, RunEval):
                self._run_eval(msg)
            elif isinstance(msg, SaveCheckpoint):
                runner = self._current(msg.epoch)
                layers, digest = runner.save(msg.round)
                self.control.send(
                    CheckpointSaved(
                        device=self.device,
                        epoch=msg.epoch,
                        round=msg.round,
                        layers=layers,
                        stage=runner.p,
                        digest=digest,
                    )
                )
            elif isinstance(msg, Collect):
                self._collect(msg)
            elif isinstance(msg, Handover):
                self._hand_over(msg)
            elif isinstance(msg, MeasureLinks):
                self.prober.start(msg)  # probes beside the stage; answers when done
            elif isinstance(msg, ProfileBlocks):
                self.control.send(self.serving.profile(msg))
            elif isinstance(msg, LoadShard):
                self.control.send(self.serving.load(msg))
            elif isinstance(msg, RunInference):
                done = self.serving.run(msg, self.control.send)
                if done is not None:
                    self.control.send(done)
            elif isinstance(msg, Shutdown):
                log.info("shutdown requested", reason=msg.reason)
                self.stopping.set()
            else:
                log.warning("unexpected control message", type=getattr(msg, "type", "?"))
        except RoundAbortedError as exc:
            # the coordinator's own doing (a new plan, a gather, a stop): nothing to report,
            # and an error of this epoch would fail what it asked for next
            self.state = "ready"
            log.info("command abandoned", command=getattr(msg, "type", "?"), reason=str(exc))
        except Exception as exc:
            # Reported, not fatal: the coordinator decides what happens to the job. Whatever
            # a peer's data made a task raise (an IndexError deep in torch too) must fail
            # the command with its name, never end the worker.
            self.state = "error"
            log.exception("command failed", command=getattr(msg, "type", "?"))
            rnd = getattr(msg, "round", -1)
            self.control.send(
                WorkerError(
                    device=self.device, epoch=epoch, round=rnd, error=f"{type(exc).__name__}: {exc}"
                )
            )

    def _model(self, spec: ModelSpec, seed: int) -> ZooModel:
        """The job's model, built once per (model, seed) and reused by re-assignments.

        Every layer's state is loaded anew by the stage, so reusing the layers is
        exact, and a recovery does not pay for building the network again.
        """
        key = json.dumps([spec.model_dump(mode="json"), seed], sort_keys=True)
        if self._zoo is None or self._zoo[0] != key:
            self._zoo = (key, build_model(spec, seed, self.settings.model_modules))
        return self._zoo[1]

    def _current(self, epoch: int) -> StageRunner:
        if self.runner is None or self.runner.epoch != epoch:
            have = self.runner.epoch if self.runner else None
            raise AsteroidError(f"no stage assigned for plan epoch {epoch} (have {have})")
        return self.runner

    def _held(self, version: int, layers: Iterable[int]) -> dict[int, HeldLayer]:
        """The copies of `layers` at `version` held here: snapshots, replicas or the live state.

        The live state counts only between rounds: inside one, batch-norm
        statistics move with every forward, and the round's start is a snapshot.
        It is copied once for all the layers that need it.
        """
        out: dict[int, HeldLayer] = {}
        live: dict[int, HeldLayer] | None = None
        runner = self.runner
        for layer in layers:
            held = self.holdings.get(version, layer)
            if (
                held is None
                and runner is not None
                and runner.round == version
                and not runner.in_round
                and runner.start <= layer < runner.end
            ):
                live = runner.layers() if live is None else live
                held = live[layer]
            if held is None:
                raise AsteroidError(
                    f"no state of layer {layer} at version {version} on {self.device} "
                    f"(holding {self.holdings.versions()})"
                )
            out[layer] = held
        return out

    def _migrate(self, msg: Assign, timings: dict[str, float]) -> dict[int, HeldLayer] | None:
        """Send peers the layers they need, then gather this stage's own at `from_round`.

        Every device sends before it waits, so the transfers run concurrently
        and no two devices wait on each other. Only the layers sent are
        serialised; the ones this device keeps go to the new stage as copies.
        None: the stage loads from Redis. `timings` gets the seconds spent
        sending (`send_s`) and waiting for the peers' layers (`wait_s`).
        """
        if msg.sources is None:
            return None
        t0 = time.perf_counter()
        version = msg.from_round
        spec = msg.plan.stages[msg.stage]
        kept = [layer for layer in range(spec.start, spec.end) if layer not in msg.sources]
        held = self._send_layers(msg.epoch, version, msg.sends, kept)
        own = {layer: held[layer] for layer in kept}
        self.holdings.reset(msg.epoch, self._backed_up(msg))
        t1 = time.perf_counter()
        migrated = self.holdings.take_migrated(
            msg.epoch,
            {layer: str(d) for layer, d in msg.sources.items()},
            self.settings.task_timeout_s,
            functools.partial(self._superseded, msg.epoch),
        )
        own.update((layer, HeldLayer(blob=blob)) for layer, blob in migrated.items())
        timings.update(send_s=t1 - t0, wait_s=time.perf_counter() - t1)
        return own

    def _superseded(self, epoch: int) -> str | None:
        """Why gathering layers for plan epoch `epoch` is moot, or None.

        The worker stops, or a newer Assign (or a Collect, a Shutdown) waits in
        the control inbox: a sender that died during this recovery made the
        coordinator assign again without it, and waiting out the task timeout
        for its layers would stall the whole job. The pool's abort flag cannot
        say so: the control thread set it for the very Assign being handled.
        """
        if self.stopping.is_set():
            return "the worker is stopping"
        with self.control.inbox.mutex:
            queued = [env.msg for env in self.control.inbox.queue]
        for m in queued:
            if isinstance(m, Collect | Shutdown) or (isinstance(m, Assign) and m.epoch > epoch):
                return f"{m.type} received"
        return None

    def _send_layers(
        self, epoch: int, version: int, sends: Mapping[DeviceId, list[int]], kept: list[int]
    ) -> dict[int, HeldLayer]:
        """Send each peer its layers at `version`; the held copies of those and of `kept`."""
        sent = {layer for layers in sends.values() for layer in layers}
        held = self._held(version, sorted(sent.union(kept)))
        for dst, layers in sorted(sends.items()):
            for layer in layers:
                part = LayerState(epoch=epoch, version=version, layer=layer, purpose="migrate")
                self.dispatcher.send(str(dst), part, [blob_tensor(held[layer].blob())])
        return held

    def _hand_over(self, msg: Handover) -> None:
        """Leaving the plan: send the layers only this device held to their new places."""
        self.dispatcher.set_peers(msg.peers)
        self._send_layers(msg.epoch, msg.version, msg.sends, [])
        log.info(
            "handed layers over",
            version=msg.version,
            to={str(d): len(layers) for d, layers in msg.sends.items()},
        )

    def _backed_up(self, msg: Assign) -> ReplicaSource | None:
        """The stage whose replica this device holds under `msg.plan`, if any."""
        held = msg.plan.backups_held(self.device)
        if not held:
            return None
        stage = msg.plan.stages[held[0]]
        return ReplicaSource(str(stage.devices[0].device), stage.start, stage.end)

    def _replica_saved(self, src: ReplicaSource, version: int) -> None:
        """Tell the coordinator a replica is complete here (called by the receiver)."""
        self.control.send(
            ReplicaSaved(
                device=self.device,
                epoch=self.holdings.epoch,
                version=version,
                origin=DeviceId(src.origin),
                start=src.start,
                end=src.end,
            )
        )

    def _collect(self, msg: Collect) -> None:
        """Write the layers held at `msg.version` to Redis (heavy recovery's gather)."""
        self._current(msg.epoch)
        blobs = {layer: held.blob() for layer, held in self._held(msg.version, msg.layers).items()}
        job = self.runner.assign.job.job_id if self.runner else ""

        def write() -> None:
            for layer, blob in blobs.items():
                self.store.put_blob(blob, "ckpt", job, msg.version, "layer", layer)

        self.store.ride_out(
            write, f"collecting version {msg.version}", self.settings.redis_outage_s, time.sleep
        )
        digest = hashlib.sha256(b"".join(blobs[layer] for layer in sorted(blobs))).hexdigest()
        self.control.send(
            CheckpointSaved(
                device=self.device,
                epoch=msg.epoch,
                round=msg.version,
                layers=sorted(blobs),
                stage=self.runner.p if self.runner else 0,
                digest=digest,
            )
        )

    def _assign(self, msg: Assign) -> None:
        t0 = time.perf_counter()
        self.state = "loading"
        self.dispatcher.set_peers(msg.peers, msg.epoch, neighbours(msg.plan, self.device))
        self.bulk.set_peers(msg.peers)
        timings: dict[str, float] = {}
        layers = self._migrate(msg, timings)
        if layers is None:
            self.holdings.reset(msg.epoch, self._backed_up(msg))
        if self.runner is not None:
            self.runner.close()
        self.runner = None
        self.runner = StageRunner(
            msg,
            self.device,
            self.store,
            self.pool,
            self.dispatcher,
            self.settings.task_timeout_s,
            self.settings.model_modules,
            self.settings.redis_outage_s,
            self.fail_at,
            layers,
            self.holdings,
            self.bulk,
            self._model(msg.job.model, msg.job.seed),
            self.accelerator.device,
        )
        bind_global(job=msg.job.job_id, stage=msg.stage, epoch=msg.epoch)
        self.state = "ready"
        timings.update(self.runner.load_timings, total_s=time.perf_counter() - t0)
        log.info(
            "stage assigned",
            layers=[self.runner.start, self.runner.end],
            group=self.runner.group,
            k=self.runner.k,
            from_round=msg.from_round,
            peers=msg.sources is not None,
            **{name: round(s, 4) for name, s in timings.items()},
        )
        self.control.send(
            Assigned(
                device=self.device,
                epoch=msg.epoch,
                round=msg.from_round,
                param_bytes=self.runner.param_bytes(),
            )
        )

    def _run_round(self, msg: RunRound) -> None:
        runner = self._current(msg.epoch)
        self.state = "training"
        bind_global(round=msg.round)
        res = runner.run_round(msg.round, msg.keep, msg.replicate)
        self._check_sends(f"round {msg.round}")
        self.state = "ready"
        self.control.send(
            RoundDone(
                device=self.device,
                epoch=msg.epoch,
                round=msg.round,
                stage=runner.p,
                samples=res.samples,
                loss_sum=res.loss_sum,
                correct=res.correct,
                max_alive=res.max_alive,
                peak_bytes=res.peak_bytes,
                peak_saved_bytes=res.peak_saved_bytes,
                timings=res.stage_timings(),
            )
        )
        if self.fail_at is not None:
            self.fail_at.check(msg.round, "done")

    def _run_eval(self, msg: RunEval) -> None:
        runner = self._current(msg.epoch)
        self.state = "evaluating"
        bind_global(round=msg.round)
        res = runner.run_eval(msg.round, msg.batches)
        self._check_sends(f"the evaluation of round {msg.round}")
        self.state = "ready"
        self.control.send(
            EvalDone(
                device=self.device,
                epoch=msg.epoch,
                round=msg.round,
                stage=runner.p,
                samples=res.samples,
                loss_sum=res.loss_sum,
                correct=res.correct,
            )
        )

    def _check_sends(self, during: str) -> None:
        """Turn a failed asynchronous send into this command's error."""
        if self.dispatcher.error is not None:
            err, self.dispatcher.error = self.dispatcher.error, None
            raise AsteroidError(f"sending to a peer failed during {during}: {err}")

    def stop(self, signal_name: str) -> None:
        """End `serve` after the command at hand, which gives up its waits now.

        A command waiting for a peer or for Redis fails at once instead of at
        its timeout, so a signalled worker stops within a second.
        """
        self.stopping.set()
        self.pool.abort(f"the worker is stopping ({signal_name})")

    def close(self) -> None:
        """Stop threads and sockets; safe to call twice.

        Every wait is bounded. A shutdown that overstays `SLOW_CLOSE_S` writes
        every thread's stack to the log (faulthandler needs neither the GIL nor
        a responsive main thread), and the context is terminated only once no
        thread of ours still uses a socket: ZeroMQ would wait for those forever.
        """
        faulthandler.dump_traceback_later(SLOW_CLOSE_S)
        try:
            self.control.close()
            self.receiver.stop.set()
            self.sink.close()
            self.prober.join(timeout_s=1.0)
            self.dispatcher.close()
            self.bulk.close()
            self.serving.close()
            threads = (
                self.receiver,
                self.dispatcher,
                self.bulk,
                self.serving.dispatcher,
                self.control,
                self.sink,
            )
            for thread in threads:
                if thread.is_alive():
                    thread.join(timeout=5)
            self.store.close()
            running = [t.name for t in threads if t.is_alive()]
            if running:
                log.error(
                    "threads did not stop; leaving their sockets to the exit", threads=running
                )
            else:
                self.ctx.destroy(linger=0)
        finally:
            faulthandler.cancel_dump_traceback_later()


def _body(settings: WorkerSettings, stop: Stop) -> ExitCode:
    """Join and serve until the coordinator's Shutdown or SIGTERM/SIGINT (exit code OK)."""
    torch.set_num_threads(settings.threads or default_threads(settings.workers_per_host))
    keep_freed_memory()
    stop.on_stop(lambda name: log.info("signal received", signal=name))
    try:
        # no Redis URL given: the coordinator says where (the password is the key set's)
        keys = load_keys(settings.keys, "worker", settings.device or None)
        settings = with_redis(settings, keys, "worker", stop.is_set)
        worker = Worker(settings)
    except CoordinatorUnreachable:  # only when stopped while asking
        log.info("stopped before the coordinator answered", coordinator=settings.coordinator)
        return ExitCode.INTERRUPTED
    except ConfigError as exc:  # e.g. its key is missing from --keys
        log.error("worker cannot start", error=str(exc))
        return ExitCode.CONFIG
    stop.on_stop(worker.stop)
    bind_global(device=worker.device)
    worker.serve()
    return ExitCode.OK


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-worker`."""
    sys.exit(run_service("worker", WorkerSettings, _body, argv))


if __name__ == "__main__":
    main()
