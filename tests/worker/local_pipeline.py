"""Stage runners of a whole plan in one process, wired by direct pool delivery.

Every device gets a real `StageRunner` and `TaskPool`; the dispatcher is
replaced by one that puts parts straight into the destination's pool (cloned,
as the wire would), so routing, scheduling and evaluation are tested without
sockets. Commands run in one thread per device with a barrier between them,
as the coordinator waits for every reply before its next command.

`run_lockstep` runs a round's tasks in one thread in a fixed order instead, so
that what each stage holds at every moment is deterministic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from common.checkpoint import commit_checkpoint, save_stage
from common.job import JobSpec
from common.messages import Activation, Assign, Gradient, ReduceChunk
from common.plan import Plan
from common.schedule import Action
from common.store import Store
from common.zoo import build_model
from services.worker.pool import TaskPool
from services.worker.stage import RoundResult, StageRunner


class DirectDispatcher:
    """Delivers into the peers' pools at once, as sent by `device`; remembers drops.

    The drops list is shared by the dispatchers of one pipeline.
    """

    def __init__(self, pools: dict[str, TaskPool], device: str, dropped: list[str]) -> None:
        self.pools = pools
        self.device = device
        self.dropped = dropped

    def send(self, dst: str, msg: Any, tensors: Any = ()) -> None:
        copies = [t.clone() for t in tensors]
        if isinstance(msg, Activation | Gradient):
            why = self.pools[dst].put_part(msg, copies, self.device)
        elif isinstance(msg, ReduceChunk):
            why = self.pools[dst].put_chunk(msg, copies[0], self.device)
        else:
            raise AssertionError(f"unexpected {msg.type} on the data plane")
        if why:
            self.dropped.append(why)


class LocalPipeline:
    """Runners of every device of `plan`, from checkpoint 0 of `job`."""

    def __init__(
        self,
        store: Store,
        job: JobSpec,
        plan: Plan,
        total_rounds: int = 0,
        timeout_s: float = 30.0,
        compute: torch.device | None = None,
    ) -> None:
        """`compute`: the device every runner computes on (the CPU by default)."""
        zoo = build_model(job.model, job.seed)
        full = zoo.full()
        save_stage(store, job.job_id, 0, full, None, 0)
        commit_checkpoint(store, job.job_id, 0, len(full))
        self.plan = plan
        self.pools = {str(d): TaskPool() for d in plan.devices}
        dropped: list[str] = []
        self.outs = {str(d): DirectDispatcher(self.pools, str(d), dropped) for d in plan.devices}
        self.out = self.outs[str(plan.devices[0])]  # `out.dropped` is every device's
        self.runners: dict[str, StageRunner] = {}
        for d in plan.devices:
            msg = Assign(
                epoch=1,
                job=job,
                plan=plan,
                stage=plan.stage_of(d),
                peers={},
                from_round=0,
                total_rounds=total_rounds,
            )
            pool = self.pools[str(d)]
            out = self.outs[str(d)]
            self.runners[str(d)] = StageRunner(msg, d, store, pool, out, timeout_s, compute=compute)

    def run(self, command: str, *args: int) -> dict[str, Any]:
        """Run `runner.<command>(*args)` on every device at once; returns the results."""
        return self._on_all(lambda _name, runner: getattr(runner, command)(*args))

    def run_lockstep(
        self, round_no: int
    ) -> tuple[dict[str, RoundResult], list[tuple[str, Action]]]:
        """Run round `round_no` with its tasks in a fixed order; returns results and that order.

        Devices take turns in plan order, each running every task its scheduler
        finds ready before the next one's turn; parts arrive the moment they are
        sent. Then every device all-reduces and steps at once (a ring needs its peers).
        """
        states = {name: r.begin_round(round_no) for name, r in self.runners.items()}
        order: list[tuple[str, Action]] = []
        while any(states[n].done_b < r.m for n, r in self.runners.items()):
            ran = len(order)
            for name, runner in self.runners.items():
                while (action := runner.ready_task(states[name])) is not None:
                    runner.run_task(states[name], action)
                    order.append((name, action))
            if len(order) == ran:
                done = [f"{n}:{a}" for n, a in order]
                raise AssertionError(f"no device can run a task after {done}")
        results = self._on_all(lambda name, runner: runner.end_round(states[name]))
        return results, order

    def _on_all(self, work: Callable[[str, StageRunner], Any]) -> dict[str, Any]:
        """Call `work(name, runner)` for every device, one thread each; returns the results."""
        results: dict[str, Any] = {}
        errors: list[BaseException] = []

        def one(name: str, runner: StageRunner) -> None:
            try:
                results[name] = work(name, runner)
            except BaseException as exc:
                errors.append(exc)
                for pool in self.pools.values():
                    pool.abort(f"{name} failed: {exc}")

        threads = [
            threading.Thread(target=one, args=(n, r), daemon=True) for n, r in self.runners.items()
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120  # one bound for the whole round, not per thread
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if errors:
            raise errors[0]
        assert len(results) == len(self.runners), "a runner did not finish"
        return results

    def last_stage(self) -> list[str]:
        """Devices of the last stage, whose results carry loss and accuracy."""
        return [str(a.device) for a in self.plan.stages[-1].devices]

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole model's state, keyed like `zoo.full().state_dict()`, from each leader."""
        out: dict[str, torch.Tensor] = {}
        for st in self.plan.stages:
            runner = self.runners[str(st.devices[0].device)]
            for key, value in runner.module.state_dict().items():
                head, _, rest = key.partition(".")
                out[f"{runner.start + int(head)}.{rest}"] = value.detach().to("cpu", copy=True)
        return out
