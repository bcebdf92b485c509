"""Per-layer measurement of a zoo model on this device.

Each layer runs forward and backward on real inputs (the synthetic dataset fed
through the layers before it), for several batch sizes, because time is not
linear in batch size. Times are medians of `repeats` runs after `warmup` runs.
What names the device a profile describes lives in `common.device`, and the
model's name in `common.model_key`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from common.accelerator import AcceleratorInfo, synchronize
from common.data import dataset_for, split_indices
from common.device import device_fingerprint
from common.errors import ConfigError
from common.model_key import model_key
from common.profile import LayerProfile, Profile
from common.saved_bytes import SavedBytes, weight_storages
from common.zoo import ModelSpec, build_model

__all__ = [
    "OPTIMIZER_STATE",
    "Optimizer",
    "ProgressFn",
    "Step",
    "auto_batch_sizes",
    "profile_model",
]

Optimizer = Literal["sgd", "adam", "adamw"]
OPTIMIZER_STATE: dict[str, int] = {"sgd": 1, "adam": 2, "adamw": 2}
"""Optimizer state per parameter byte: SGD momentum keeps one buffer, Adam two."""


@dataclass(frozen=True)
class Step:
    """Where profiling stands: `done` of `total` (layer, batch size) measurements."""

    done: int
    total: int
    layer: int
    layers: int
    batch: int


ProgressFn = Callable[[Step], None]
"""Called after each (layer, batch size) measured."""

HEADROOM = 0.5
"""Share of the memory budget automatic batch sizes plan for; the rest covers what the
estimate leaves out (allocator slack, convolution workspaces, temporaries)."""

WARM_ENOUGH_S = 0.2
"""A first run longer than this is warm-up enough (see `_measure`)."""

CALIBRATE_S = 0.3
"""Seconds of whole passes per batch size that calibrate the per-layer medians."""

_CPU = torch.device("cpu")


def _layer_name(layer: nn.Module) -> str:
    """A plain Sequential by what it chains ("Conv2d+ReLU"), anything else by its class."""
    if type(layer) is nn.Sequential and len(layer) > 0:
        return "+".join(type(m).__name__ for m in layer.children())[:80]
    return type(layer).__name__


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def auto_batch_sizes(per_sample: int, fixed: int, budget: int, cap: int = 256) -> list[int]:
    """Powers of two up to the largest batch whose estimated memory fits `budget`.

    `fixed` bytes are needed whatever the batch, `per_sample` for each sample;
    only `HEADROOM` of the budget is planned for. Without a budget (0) the list
    runs to `cap`; it always holds at least batch 1.
    """
    if budget > 0:
        usable = int(budget * HEADROOM) - fixed
        cap = min(cap, usable // max(1, per_sample))
    sizes = [1]
    while sizes[-1] * 2 <= cap:
        sizes.append(sizes[-1] * 2)
    return sizes


def _footprint(layers: list[nn.Module], x: torch.Tensor) -> int:
    """Most bytes per sample any one layer needs while profiled on batch `x`.

    Its input and the input's gradient, its output and upstream gradient, and
    what it saves for backward: the profiler holds one layer's tensors at a time.
    """
    worst = 0
    batch = x.shape[0]
    for layer in layers:
        saved = SavedBytes(weight_storages(layer))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = layer(x.detach().requires_grad_(x.is_floating_point()))
        need = 2 * _nbytes(x) + 2 * _nbytes(out) + saved.total
        worst = max(worst, -(-need // batch))
        x = out.detach()
    return worst


def _check(batch_sizes: list[int] | None, repeats: int, warmup: int) -> list[int] | None:
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if batch_sizes is None or not batch_sizes:
        return None
    if any(b < 1 for b in batch_sizes):
        raise ConfigError(f"batch sizes must be >= 1, got {batch_sizes}")
    return sorted(set(batch_sizes))


def profile_model(
    spec: ModelSpec,
    batch_sizes: list[int] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    memory_budget: int = 0,
    progress: ProgressFn | None = None,
    *,
    optimizer: Optimizer = "sgd",
    max_batch: int = 256,
    device: str = "",
    seed: int = 0,
    allowed_modules: Collection[str] = (),
    accelerator: AcceleratorInfo | None = None,
) -> Profile:
    """Measure every layer of `spec` on this device at each batch size.

    Args:
        spec: The model; built with `seed` (weights do not change timings).
        batch_sizes: Batch sizes to measure; None or empty: powers of two up to
            the largest that fits `memory_budget` (see `auto_batch_sizes`), at
            most `max_batch`.
        repeats: Timed runs per (layer, batch size); the profile keeps medians.
        warmup: Untimed runs before them.
        memory_budget: Bytes the device may use (0: unknown); also recorded.
        progress: Called after each (layer, batch size).
        optimizer: Which optimizer's state `optimizer_bytes` counts.
        max_batch: Upper bound of automatic batch sizes.
        device: Device fingerprint to record; empty: this process's.
        seed: Seed of the model's weights and of the data fed through it.
        allowed_modules: The service's ``model_modules`` setting: the only modules a
            ``module:factory`` model may come from (a request cannot widen it).
        accelerator: Where the layers run, as a worker's stage will (None: the CPU);
            a GPU is named in the default fingerprint and synchronized around timings.

    Times use the current torch thread count. The backward of a layer computes
    its parameters' gradients and, from layer 1 on, its input's gradient: the
    first stage has no upstream to send one to, exactly as the worker runs it.
    Per-sample bytes are taken at the largest batch size measured.

    Raises:
        ConfigError: Bad arguments or model spec, or a layer failing to run.

    """
    sizes = _check(batch_sizes, repeats, warmup)
    if optimizer not in OPTIMIZER_STATE:
        raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {optimizer!r}")
    model = build_model(spec, seed, allowed_modules)
    on = torch.device("cpu") if accelerator is None else accelerator.device
    layers = model.layers
    for layer in layers:
        layer.to(on).train()
    data = dataset_for(model, seed)

    def inputs(batch: int) -> torch.Tensor:
        """The first `batch` training samples, on the device profiled."""
        return data.batch(split_indices("train", 0, batch))[0].to(on)

    params = [list(layer.parameters()) for layer in layers]
    param_bytes = [sum(_nbytes(p) for p in ps) for ps in params]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if sizes is None:
            probe = inputs(1)
            per_sample = _footprint(layers, probe)
            sizes = auto_batch_sizes(per_sample, 2 * sum(param_bytes), memory_budget, max_batch)
        fwd: list[list[float]] = [[] for _ in layers]
        bwd: list[list[float]] = [[] for _ in layers]
        out_bytes = [0] * len(layers)
        saved_bytes = [0] * len(layers)
        total, done = len(layers) * len(sizes), 0
        for b in sizes:
            x = inputs(b)
            for i, layer in enumerate(layers):
                x = x.detach().requires_grad_(i > 0 and x.is_floating_point())
                try:
                    f, bk, out, saved = _measure(layer, params[i], x, repeats, warmup, on)
                except (RuntimeError, ValueError, TypeError) as exc:
                    raise ConfigError(f"layer {i} failed on a batch of {b}: {exc}") from exc
                fwd[i].append(f)
                bwd[i].append(bk)
                out_bytes[i] = -(-_nbytes(out) // b)
                saved_bytes[i] = -(-saved // b)
                x = out
                done += 1
                if progress is not None:
                    progress(Step(done, total, i, len(layers), b))
            scale = _calibration(layers, inputs(b), fwd, bwd, on)
            for times in (*fwd, *bwd):
                times[-1] *= scale
    factor = OPTIMIZER_STATE[optimizer]
    return Profile(
        model=model_key(spec),
        device=device
        or device_fingerprint(torch.get_num_threads(), memory_budget, accelerator=accelerator),
        batch_sizes=sizes,
        input_bytes=math.prod(model.input.shape) * model.input.dtype.itemsize,
        memory_budget=memory_budget,
        layers=[
            LayerProfile(
                index=i,
                name=_layer_name(layer),
                forward_s=fwd[i],
                backward_s=bwd[i],
                output_bytes=out_bytes[i],
                activation_bytes=saved_bytes[i],
                param_bytes=param_bytes[i],
                optimizer_bytes=factor * sum(_nbytes(p) for p in params[i] if p.requires_grad),
            )
            for i, layer in enumerate(layers)
        ],
        created=time.time(),
    )


def _calibration(
    layers: list[nn.Module],
    x: torch.Tensor,
    fwd: list[list[float]],
    bwd: list[list[float]],
    on: torch.device = _CPU,
) -> float:
    """How much longer whole passes take than the sum of the layers' medians (>= 1).

    Medians of short, separately timed layers miss what a whole pass pays:
    time between layers, and above all a CPU quota (a cgroup, a container) that
    lets a process run at full speed for part of each scheduling period and
    then stops it. A layer shorter than that part is mostly timed at full speed;
    passes timed back to back for `CALIBRATE_S` see the quota's average rate.
    """
    medians = sum(f[-1] + b[-1] for f, b in zip(fwd, bwd, strict=True))
    if medians <= 0:
        return 1.0
    synchronize(on)
    passes, t0 = 0, time.perf_counter()
    while passes < 2 or time.perf_counter() - t0 < CALIBRATE_S:
        h = x.detach().requires_grad_(False)
        for layer in layers:
            h = layer(h)
        h.float().sum().backward()  # type: ignore[no-untyped-call]
        synchronize(on)
        passes += 1
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return max(1.0, (time.perf_counter() - t0) / passes / medians)


def _measure(
    layer: nn.Module,
    params: list[nn.Parameter],
    x: torch.Tensor,
    repeats: int,
    warmup: int,
    on: torch.device = _CPU,
) -> tuple[float, float, torch.Tensor, int]:
    """Median forward and backward seconds, the output (detached) and saved bytes.

    A first run with saved-tensor hooks counts the bytes kept for backward and
    is the first warm-up run (hooks cost time, so it is never timed). Further
    warm-up runs are skipped when that run took over `WARM_ENOUGH_S`: one-off
    costs (kernel set-up, allocator growth) are paid by then, and at large
    batches another run would only make the profile slower. On a GPU every
    timer reads after a synchronize, so it times the kernels, not their launch.
    """
    saved = SavedBytes(weight_storages(layer))
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        out = layer(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"returned {type(out).__name__}, not a tensor")
    grad = torch.randn_like(out) if out.requires_grad else None
    if grad is not None:
        torch.autograd.backward([out], [grad])
    result = out.detach()
    del out
    synchronize(on)
    warmup = max(0, warmup - 1) if time.perf_counter() - t0 < WARM_ENOUGH_S else 0
    forward: list[float] = []
    backward: list[float] = []
    for run in range(warmup + repeats):
        x.grad = None
        synchronize(on)
        t0 = time.perf_counter()
        out = layer(x)
        synchronize(on)
        t1 = time.perf_counter()
        if grad is not None:
            torch.autograd.backward([out], [grad])
        synchronize(on)
        t2 = time.perf_counter()
        del out
        if run >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1 if grad is not None else 0.0)
    x.grad = None
    for p in params:
        p.grad = None
    return statistics.median(forward), statistics.median(backward), result, saved.total
