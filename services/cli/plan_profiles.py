"""The profile names a cluster file may give its devices, and the profiles they stand for.

A person writing a cluster for `asteroid plan` knows what their devices are, not
a profile's Redis key. So a device's `profile:` is one of three kinds of name:

* a device kind shipped with the testbed (`jetson-nano`, `xavier-nx`, `nano-m`...):
  the model's per-layer work is counted (floating-point operations of forward and
  backward, bytes kept and sent) and divided by the kind's peak throughput times
  `EFFICIENCY`; an estimate, but one that needs neither Redis nor the device;
* `here`: the model measured on this machine now, by the profiler's own code;
* a device fingerprint the profiler stored in Redis for this model (or, as before,
  a whole stored key `MODEL:FINGERPRINT`).

Anything else is refused in one line with the closest names and the list.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import ConfigError
from common.profile import LayerProfile, Profile
from services.testbed.presets import DEVICE_KINDS, DeviceKind

if TYPE_CHECKING:
    from common.store import Store
    from common.zoo import ModelSpec

__all__ = [
    "EFFICIENCY",
    "HERE",
    "KINDS",
    "ProfileName",
    "UnknownProfile",
    "estimated_profile",
    "kind_slug",
    "measured_here",
    "resolve_profiles",
    "unknown_profile",
]

HERE = "here"
"""The profile name that means: measure the model on this machine now."""

EFFICIENCY = 0.25
"""Share of a kind's peak throughput that small-batch training reaches. A guess, but
one shared by every kind: the split between kinds follows their peak ratios, which
is what the testbed emulates too (`services.testbed.presets.slowdown`)."""

HERE_REPEATS = 3
"""Timed runs per (layer, batch size) for `here`: enough for a median, quick to take."""


def kind_slug(kind: DeviceKind) -> str:
    """The name a cluster file uses for `kind`: "Jetson Nano" -> "jetson-nano"."""
    return kind.name.lower().replace(" ", "-")


KINDS: dict[str, DeviceKind] = {kind_slug(k): k for k in DEVICE_KINDS.values()}
"""Every shipped device kind by its cluster-file name."""


@dataclass(frozen=True)
class ProfileName:
    """One name `asteroid plan --list-profiles` shows: what it is and where it comes from."""

    name: str
    memory_bytes: int
    what: str


def known_names(stored: Iterable[str] = ()) -> list[ProfileName]:
    """The shipped kinds, `here`, then the fingerprints stored in Redis for the model."""
    out = [
        ProfileName(slug, k.memory_bytes, f"{k.name}: {k.tflops:.3g} TFLOPS peak, estimated")
        for slug, k in KINDS.items()
    ]
    out.append(ProfileName(HERE, 0, "this machine, measured when the plan is made"))
    out += [ProfileName(f, 0, "profiled into Redis by asteroid-profiler") for f in stored]
    return out


class UnknownProfile(ConfigError):
    """A device's profile name that is no kind, not `here` and not stored; `close`: the nearest."""

    def __init__(self, message: str, close: list[str]) -> None:
        super().__init__(message)
        self.close = close


def unknown_profile(name: str, device: str, names: list[str]) -> UnknownProfile:
    """One line: the unknown name, the closest known ones, and all of them."""
    close = difflib.get_close_matches(name, names, n=2, cutoff=0.5)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return UnknownProfile(
        f"device {device}: unknown profile {name!r}{hint}; known: {', '.join(names)}", close
    )


def _layer_costs(spec: ModelSpec) -> tuple[list[float], list[float], list[list[int]], int]:
    """Per layer at batch 1: forward FLOPs, backward FLOPs, [out, saved, params] bytes; input bytes.

    Counted rather than timed (torch's FlopCounterMode), so the figures are the
    same on every machine and cost one pass; batch 1 is enough because the work
    of the layers the zoo holds grows linearly with the batch.
    """
    import math

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common.data import dataset_for, split_indices
    from common.saved_bytes import SavedBytes, weight_storages
    from common.zoo import build_model

    model = build_model(spec, 0)
    x = dataset_for(model, 0).batch(split_indices("train", 0, 1))[0]
    fwd: list[float] = []
    bwd: list[float] = []
    sizes: list[list[int]] = []
    for i, layer in enumerate(model.layers):
        layer.train()
        x = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        saved = SavedBytes(weight_storages(layer))
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
        with FlopCounterMode(display=False) as f_count, hooks:
            out = layer(x)
        with FlopCounterMode(display=False) as b_count:
            if out.requires_grad:
                torch.autograd.backward([out], [torch.ones_like(out)])
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        fwd.append(float(f_count.get_total_flops()))
        bwd.append(float(b_count.get_total_flops()))
        sizes.append([out.numel() * out.element_size(), saved.total, params])
        x = out.detach()
    input_bytes = math.prod(model.input.shape) * model.input.dtype.itemsize
    return fwd, bwd, sizes, input_bytes


def estimated_profile(spec: ModelSpec, slug: str) -> Profile:
    """`spec` on device kind `slug`, from counted work and the kind's peak throughput.

    A layer with no multiply-adds (an activation, a pooling) costs one operation
    per byte it writes, so no layer is free and splits are never placed for nothing.
    """
    from common.model_key import model_key

    kind = KINDS[slug]
    rate = kind.tflops * 1e12 * EFFICIENCY
    fwd, bwd, sizes, input_bytes = _layer_costs(spec)
    layers = [
        LayerProfile(
            index=i,
            forward_s=[max(f, out) / rate],
            backward_s=[max(b, out) / rate if i > 0 or b > 0 else 0.0],
            output_bytes=out,
            activation_bytes=saved,
            param_bytes=params,
            optimizer_bytes=params,  # SGD's momentum, as the profiler counts by default
        )
        for i, (f, b, (out, saved, params)) in enumerate(zip(fwd, bwd, sizes, strict=True))
    ]
    return Profile(
        model=model_key(spec),
        device=f"kind:{slug}",
        batch_sizes=[1],
        input_bytes=input_bytes,
        memory_budget=kind.memory_bytes,
        layers=layers,
    )


def measured_here(spec: ModelSpec, micro: int) -> Profile:
    """`spec` measured on this machine at batch 1 and one micro-batch (`micro` samples)."""
    from services.profiler.layers import profile_model

    sizes = sorted({1, max(1, micro)})
    return profile_model(spec, sizes, repeats=HERE_REPEATS, warmup=1)


def _stored(store: Store, key: str, name: str) -> Profile | None:
    """The profile of model `key` on fingerprint `name`, else under the whole key `name`."""
    from pydantic import ValidationError

    for where in (f"{key}:{name}", name):
        data = store.get_json("profile", where)
        if data is not None:
            try:
                return Profile.model_validate(data)
            except ValidationError as exc:
                raise ConfigError(f"profile {where!r} in Redis is invalid: {exc}") from exc
    return None


def resolve_profiles(
    wanted: dict[str, str], spec: ModelSpec, micro: int, store: Store | None
) -> dict[str, Profile]:
    """The profile of every name in `wanted` (profile name -> a device naming it).

    `store` is None when no Redis answered: then only kinds and `here` resolve,
    and an unknown name's error lists no stored fingerprints.

    Raises:
        ConfigError: A name that is none of the above (one line, did-you-mean).

    """
    from common.model_key import model_key

    key = model_key(spec)
    out: dict[str, Profile] = {}
    for name, device in sorted(wanted.items()):
        if name in KINDS:
            out[name] = estimated_profile(spec, name)
        elif name == HERE:
            out[name] = measured_here(spec, micro)
        else:
            found = None if store is None else _stored(store, key, name)
            if found is None:
                stored = [] if store is None else stored_fingerprints(store, key)
                raise unknown_profile(name, device, [p.name for p in known_names(stored)])
            out[name] = found
    return out


def stored_fingerprints(store: Store, key: str) -> list[str]:
    """Devices the profiler measured model `key` on (the `profiles:<key>` hash)."""
    return sorted(str(f) for f in store.get_fields("profiles", key))
