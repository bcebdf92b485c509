"""The cost model every planner and the simulator share.

Times come from per-device profiles (interpolated in batch size, scaled by a
device's slowdown), memory from per-layer byte counts, communication from the
cluster's bandwidth matrix. Prefix sums over layers make a stage's time an
O(1) lookup, which keeps the dynamic-programming planners fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

from common.errors import ConfigError
from common.ids import DeviceId
from common.memory_model import replica_bytes, stage_bytes, stashed_copies
from common.plan import Plan
from common.profile import ClusterSpec, Profile

__all__ = ["CostModel"]


@dataclass
class CostModel:
    """Costs of layer ranges on devices, given profiles and a cluster."""

    profiles: dict[str, Profile]
    cluster: ClusterSpec
    mode: Literal["sync", "async"] = "sync"
    """The job's training mode: async stages also hold stashed weight versions."""
    aggregate: bool = False
    """async with FTPipeHD's aggregation: the versions it averages are kept too."""
    _prefix: dict[tuple[str, int, str], list[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ConfigError("the planner needs at least one profile")
        counts = {len(p.layers) for p in self.profiles.values()}
        if len(counts) != 1:
            raise ConfigError(f"profiles describe models of different depths: {sorted(counts)}")
        for d in self.cluster.devices:
            self.profile(d.name)  # every device resolves to a profile
        ref = next(iter(self.profiles.values()))
        self.num_layers = len(ref.layers)
        self._params = [0, *accumulate(lp.param_bytes for lp in ref.layers)]
        self._optim = [0, *accumulate(lp.optimizer_bytes for lp in ref.layers)]
        self._act = [0, *accumulate(lp.activation_bytes for lp in ref.layers)]
        self._out = [lp.output_bytes for lp in ref.layers]

    # --- lookups --------------------------------------------------------------

    def profile(self, device: str) -> Profile:
        """The profile describing `device` (its own key, else the only profile)."""
        key = self.cluster.device(device).profile
        if key in self.profiles:
            return self.profiles[key]
        if not key and len(self.profiles) == 1:
            return next(iter(self.profiles.values()))
        raise ConfigError(f"device {device} names profile {key!r}, which was not given")

    def compute(self, device: str, start: int, end: int, batch: int, kind: str) -> float:
        """Seconds of forward ("F") or backward ("B") of layers [start, end) on `batch`."""
        if batch <= 0 or end <= start:
            return 0.0
        key = (device, batch, kind)
        prefix = self._prefix.get(key)
        if prefix is None:
            prof = self.profile(device)
            slow = self.cluster.device(device).slowdown
            times = (slow * prof.time(i, batch, kind) for i in range(self.num_layers))
            prefix = [0.0, *accumulate(times)]
            self._prefix[key] = prefix
        return prefix[end] - prefix[start]

    def step(self, device: str, start: int, end: int, batch: int) -> float:
        """Forward plus backward seconds of one micro-batch share."""
        return self.compute(device, start, end, batch, "F") + self.compute(
            device, start, end, batch, "B"
        )

    def boundary_bytes(self, end: int, samples: int) -> int:
        """Bytes crossing the boundary after layer `end - 1` for `samples` samples."""
        return self._out[end - 1] * samples

    def transfer(self, src: str, dst: str, nbytes: int) -> float:
        """Seconds to move `nbytes` from `src` to `dst`."""
        if src == dst or nbytes == 0:
            return 0.0
        return self.cluster.latency_s + nbytes / self.cluster.bw(src, dst)

    def param_bytes(self, start: int, end: int) -> int:
        """Parameter bytes of layers [start, end)."""
        return self._params[end] - self._params[start]

    def allreduce(self, devices: Sequence[str], start: int, end: int) -> float:
        """Ring all-reduce of the gradients of layers [start, end) over `devices`."""
        n = len(devices)
        if n <= 1:
            return 0.0
        slowest = min(self.cluster.bw(devices[i], devices[(i + 1) % n]) for i in range(n))
        steps = 2 * (n - 1)
        nbytes = self.param_bytes(start, end)
        return steps * (self.cluster.latency_s + nbytes / n / slowest)

    def memory(self, start: int, end: int, samples: int, in_flight: int) -> int:
        """Peak bytes of a device running layers [start, end) (Asteroid's Eq. 3).

        Weights, gradients and optimizer state, plus the activations of
        `in_flight` micro-batch shares of `samples` samples kept for backward;
        the formula lives in common so recovery checks survivors against it too.
        """
        return stage_bytes(
            self._params[end] - self._params[start],
            self._optim[end] - self._optim[start],
            self._act[end] - self._act[start],
            samples,
            in_flight,
        )

    def replica(self, start: int, end: int) -> int:
        """Bytes a backup node keeps for the replica of layers [start, end)."""
        return replica_bytes(
            self._params[end] - self._params[start], self._optim[end] - self._optim[start]
        )

    def reserved(self, plan: Plan) -> dict[str, int]:
        """Replica bytes each device of `plan` holds for other stages (0 for most).

        They depend only on the layer ranges and the groups, never on the
        shares, so a stage's split can be fitted around them.
        """
        return {
            dev: sum(
                self.replica(plan.stages[s].start, plan.stages[s].end)
                for s in plan.backups_held(DeviceId(dev))
            )
            for dev in plan.devices
        }

    def plan_memory(self, plan: Plan) -> dict[str, int]:
        """Predicted peak bytes of every device of `plan`, backup replicas included."""
        reserved = self.reserved(plan)
        out: dict[str, int] = {}
        for s, stage in enumerate(plan.stages):
            k = plan.warmup(s)
            stash = self.stashed(stage.start, stage.end, plan.warmup(0))
            for dev, (lo, hi) in plan.ranges(s).items():
                out[dev] = self.memory(stage.start, stage.end, hi - lo, k) + reserved[dev] + stash
        return out

    def stashed(self, start: int, end: int, k0: int) -> int:
        """Bytes of the weight versions an async stage of layers [start, end) stashes (0 sync)."""
        if self.mode == "sync":
            return 0
        copies = stashed_copies(k0, self.aggregate)
        return copies * (self._params[end] - self._params[start])
