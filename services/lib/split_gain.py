"""What Duan & Wu's split actually gains on this device: a pair on two lanes vs in turn.

The planner's model of the split (a phase on a share s of the device takes
its whole-device time over s, `services.planner.duanwu`) holds only where the
device really divides: on one core the two lanes time-slice and the pair is
no shorter, and on two cores it depends on how well each operator used both.
So the gain is measured, not assumed: the forward of one micro-batch and the
backward of another, first one after the other on all of the device's cores
(the intra-op threads spread over them), then at once on `SplitLanes` (each
lane pinned to its share of the cores where there are two or more). The
gain is in-turn time over split time, minus one: > 0 where the split pays.
The planner splits a device only where this was measured above its margin.

Shared by the profiler (which records the gain in a device's profile,
`Profile.split_gain`) and the worker (whose `services.worker.split_gain`
command measures a layer range inside a device).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from common.errors import ConfigError
from common.profile import Profile
from common.zoo import ModelSpec, build_model
from services.lib.lanes import SplitLanes, bound_to, device_cores, single_thread

__all__ = ["SplitGain", "layer_range", "measure_split_gain", "with_split_gain"]


@dataclass(frozen=True)
class SplitGain:
    """One measurement: phase times, pair times (medians, seconds), the beta and cores used."""

    forward_s: float
    backward_s: float
    in_turn_s: float
    split_s: float
    beta: float
    cores: int
    pinned: bool
    in_turn_one_s: float = 0.0
    """The pair in turn at ONE intra-op thread on the same cores (0: not measured)."""

    @property
    def in_turn_best_s(self) -> float:
        """The pair in turn the faster unsplit way: one thread per core, or a single thread.

        Intra-op threads in a CPU quota below the core count (or on a busy
        machine) spin and burn the quota, so a worker that does not split would
        run at one thread there; the split must beat that, not a slow way.
        """
        return min(t for t in (self.in_turn_s, self.in_turn_one_s) if t > 0)

    @property
    def best_threads(self) -> int:
        """Intra-op threads of the faster unsplit way (what plain should run with)."""
        return 1 if 0 < self.in_turn_one_s < self.in_turn_s else self.cores

    @property
    def gain(self) -> float:
        """Best in-turn time over split time, minus one: 0.05 is a pair 1 / 1.05 as long.

        The gain the planner weighs: against the unsplit worker at its best thread count.
        """
        return self.in_turn_best_s / self.split_s - 1.0 if self.split_s > 0 else 0.0

    @property
    def threads_gain(self) -> float:
        """The gain against in turn at one intra-op thread per core only (for reports).

        Where that is slower than one thread, part of this figure is that loss,
        which one thread unsplit avoids as well: `gain` leaves it out.
        """
        return self.in_turn_s / self.split_s - 1.0 if self.split_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | bool]:
        """The fields and the gains, for results files."""
        return {
            **asdict(self),
            "gain": self.gain,
            "threads_gain": self.threads_gain,
            "best_threads": self.best_threads,
        }


def _interleaved(
    runs: Sequence[Callable[[], object]], prepare: Callable[[], object], repeats: int
) -> list[float]:
    """Median seconds of each of `runs`, in turns (ABAB, then BABA), `prepare` before each.

    Taking them in turns rather than one block after the other keeps a change in
    the machine's load (other processes on its cores) from landing on one side only.
    """
    out: list[list[float]] = [[] for _ in runs]
    for r in range(repeats):
        order = list(range(len(runs)))
        for i in order if r % 2 == 0 else order[::-1]:
            prepare()
            t0 = time.perf_counter()
            runs[i]()
            out[i].append(time.perf_counter() - t0)
    return [statistics.median(times) for times in out]


def measure_split_gain(
    module: nn.Module,
    inputs: torch.Tensor,
    beta: float | None = None,
    repeats: int = 5,
    warmup: int = 1,
    cores: Collection[int] | None = None,
) -> SplitGain:
    """Time a forward+backward pair of `module` on `inputs` in turn and on two lanes.

    In turn runs with one intra-op thread per core (all of `cores`, default
    this process's affinity); the split runs on `SplitLanes(beta, cores=...)`.
    `beta` None takes Theorem 1's F / (F + B) from the phases measured alone.
    The caller's thread count is restored.

    Raises:
        ConfigError: Fewer than one repetition, or a negative warmup.

    """
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    have = frozenset(cores) if cores is not None else device_cores() or frozenset({0})
    x = inputs.detach().requires_grad_(inputs.is_floating_point())
    pending: list[torch.Tensor] = []

    def prepare() -> None:
        module.zero_grad(set_to_none=True)
        pending[:] = [module(x).float().square().mean()]

    def forward() -> None:
        module(x)  # with its graph, as a stage's forward keeps it for the backward

    def backward() -> None:
        torch.autograd.backward(pending.pop())

    def pair() -> None:
        forward()
        backward()

    def pair_one() -> None:
        with single_thread():
            pair()

    before = torch.get_num_threads()
    torch.set_num_threads(len(have))
    try:
        # this thread (and the lane thread it starts, which inherits its mask) on
        # exactly `cores`: one core is then really one core, whatever the machine has
        with bound_to(have):
            for _ in range(warmup):
                prepare()
                forward()
                backward()
            f, b = _interleaved([forward, backward], prepare, repeats)
            share = (0.5 if f + b <= 0 else f / (f + b)) if beta is None else beta
            lanes = SplitLanes(share, cores=have)
            try:
                for _ in range(warmup):
                    prepare()
                    lanes.run(forward, backward)
                in_turn, split, in_turn_one = _interleaved(
                    [pair, lambda: lanes.run(forward, backward), pair_one], prepare, repeats
                )
            finally:
                lanes.close()
    finally:
        torch.set_num_threads(before)
    return SplitGain(f, b, in_turn, split, share, len(have), lanes.pinned, in_turn_one)


def with_split_gain(profile: Profile, gain: float) -> Profile:
    """`profile` carrying the device's measured split gain (what the planner reads)."""
    return profile.model_copy(update={"split_gain": gain})


def layer_range(
    spec: ModelSpec | dict[str, object],
    lo: int,
    hi: int,
    micro: int,
    seed: int = 0,
    allowed_modules: Collection[str] = (),
) -> tuple[nn.Module, torch.Tensor]:
    """Layers [lo, hi) of the zoo model `spec` and their input for `micro` random samples.

    `allowed_modules` as `build_model` takes it (the only modules a
    ``module:factory`` model may come from).

    Raises:
        ConfigError: A bad spec, or a range outside the model's layers.

    """
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec.model_validate(spec)
    model = build_model(spec, seed, allowed_modules)
    if not 0 <= lo < hi <= len(model.layers) or micro < 1:
        raise ConfigError(f"layers [{lo}, {hi}) of {len(model.layers)}, micro-batch {micro}")
    gen = torch.Generator().manual_seed(seed)
    shape = (micro, *model.input.shape)
    if model.input.kind == "tokens":
        x = torch.randint(0, model.input.vocab_size or 2, shape, generator=gen)
    else:
        x = torch.randn(shape, generator=gen, dtype=model.input.dtype)
    with torch.no_grad():
        for layer in model.layers[:lo]:
            x = layer.train()(x)
    return nn.Sequential(*model.layers[lo:hi]).train(), x
