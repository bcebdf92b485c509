"""`asteroid-worker`: one per device; joins the coordinator and runs its stage.

Main thread: commands from the coordinator (assign, run round, evaluate,
checkpoint, shutdown) and all torch compute. Side threads: control link
(heartbeats), receiver (task pool) and dispatcher (sends). A failure inside a
command is reported to the coordinator as a WorkerError; the worker keeps
serving.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
from typing import Any

import torch
import zmq
from pydantic_settings import CliApp
from torch import nn

from common.codec import Limits
from common.curve import load_keys
from common.device import (
    cpu_quota,
    device_fingerprint,
    training_budget,
    visible_cores,
)
from common.errors import AsteroidError, ConfigError
from common.exit_codes import ExitCode
from common.ids import DeviceId
from common.logging import bind_global, configure_logging, get_logger
from common.memory import keep_freed_memory
from common.messages import (
    Assign,
    Assigned,
    CheckpointSaved,
    EvalDone,
    Heartbeat,
    RoundDone,
    RunEval,
    RunRound,
    SaveCheckpoint,
    Shutdown,
    WorkerError,
)
from common.settings import WorkerSettings
from common.store import Store
from services.worker.addressing import data_hosts
from services.worker.control import ControlLink
from services.worker.faults import FailAt
from services.worker.pool import TaskPool
from services.worker.stage import StageRunner
from services.worker.transport import Dispatcher, Receiver

__all__ = ["Worker", "main"]

log = get_logger(__name__)


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
        bind, host = data_hosts(settings.data_host, settings.advertise_host, settings.coordinator)
        self.receiver = Receiver(
            self.ctx, f"tcp://{bind}:{settings.data_port}", self.limits, self.pool, keys
        )
        self.data_addr = f"tcp://{host}:{self.receiver.endpoint.rsplit(':', 1)[1]}"
        self.dispatcher = Dispatcher(self.ctx, self.device, keys)
        self.control = ControlLink(
            self.ctx,
            settings.coordinator,
            self.device,
            self.limits,
            settings.heartbeat_s,
            self._heartbeat,
            self.pool.abort,
            keys,
        )
        self.fingerprint = device_fingerprint(torch.get_num_threads(), settings.memory_budget)
        self.budget = settings.memory_budget
        self.runner: StageRunner | None = None
        self.state = "idle"
        self.stopping = threading.Event()
        self.fail_at = FailAt.parse(settings.fail_at)
        # The worker's own Redis URL and credentials (its per-role ACL user), never the
        # coordinator's: assignments name no Redis. redis-py connects on first use.
        self.store = Store(settings.redis_url, settings.cluster)

    def _heartbeat(self) -> Heartbeat:
        r = self.runner
        return Heartbeat(
            device=self.device,
            data_addr=self.data_addr,
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
            waiting=r.waiting if r else False,
        )

    def serve(self) -> None:
        """Run until told to shut down (or SIGTERM/SIGINT)."""
        _warm_up()
        # measured after torch is loaded: what is left is what training may use
        self.budget = training_budget(self.settings.memory_budget)
        self.receiver.start()
        self.dispatcher.start()
        self.control.start()
        log.info(
            "worker started",
            data=self.data_addr,
            coordinator=self.settings.coordinator,
            redis=self.store.where,
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
            elif isinstance(msg, Shutdown):
                log.info("shutdown requested", reason=msg.reason)
                self.stopping.set()
            else:
                log.warning("unexpected control message", type=getattr(msg, "type", "?"))
        except (AsteroidError, RuntimeError, ValueError, KeyError, MemoryError) as exc:
            # Reported, not fatal: the coordinator decides what happens to the job.
            self.state = "error"
            log.exception("command failed", command=getattr(msg, "type", "?"))
            rnd = getattr(msg, "round", -1)
            self.control.send(
                WorkerError(
                    device=self.device, epoch=epoch, round=rnd, error=f"{type(exc).__name__}: {exc}"
                )
            )

    def _current(self, epoch: int) -> StageRunner:
        if self.runner is None or self.runner.epoch != epoch:
            have = self.runner.epoch if self.runner else None
            raise AsteroidError(f"no stage assigned for plan epoch {epoch} (have {have})")
        return self.runner

    def _assign(self, msg: Assign) -> None:
        self.state = "loading"
        self.runner = None
        self.dispatcher.set_peers(msg.peers)
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
        )
        bind_global(job=msg.job.job_id, stage=msg.stage, epoch=msg.epoch)
        self.state = "ready"
        log.info(
            "stage assigned",
            layers=[self.runner.start, self.runner.end],
            group=self.runner.group,
            k=self.runner.k,
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
        res = runner.run_round(msg.round)
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

    def close(self) -> None:
        """Stop threads and sockets; safe to call twice."""
        self.control.close()
        self.receiver.stop.set()
        self.dispatcher.close()
        self.receiver.join(timeout=5)
        self.dispatcher.join(timeout=5)
        self.store.close()
        self.ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asteroid-worker`."""
    settings = CliApp.run(WorkerSettings, cli_args=sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(settings.threads or default_threads(settings.workers_per_host))
    keep_freed_memory()
    configure_logging(settings.log_level, settings.log_format)
    try:
        worker = Worker(settings)
    except ConfigError as exc:  # e.g. its key is missing from --keys
        log.error("worker cannot start", error=str(exc))
        sys.exit(int(ExitCode.CONFIG))
    bind_global(device=worker.device)

    def _stop(signum: int, _: object) -> None:
        log.info("signal received", signal=signal.Signals(signum).name)
        worker.stopping.set()
        # a command waiting for a peer or for Redis gives up now instead of at its timeout
        worker.pool.abort(f"the worker is stopping ({signal.Signals(signum).name})")

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.serve()


if __name__ == "__main__":
    main()
