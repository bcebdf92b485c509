"""Hand-built profiles, clusters and plans for planner tests.

Times are linear in batch size and dyadic (exact in binary floating point), so
that tests can assert schedule formulas with exact ties instead of tolerances.
"""

from __future__ import annotations

from common.plan import Allocation, Plan, StageSpec
from common.profile import ClusterSpec, DeviceSpec, LayerProfile, Profile
from services.planner.cost import CostModel

MiB = 1 << 20


def make_profile(
    layers: int = 8,
    f: float = 2.0**-10,
    b: float = 2.0**-9,
    out_bytes: int = 4096,
    act_bytes: int = 8192,
    param_bytes: int = MiB,
) -> Profile:
    """A model of `layers` identical layers; per sample: f s forward, b s backward."""
    return Profile(
        model="synthetic",
        device="ref",
        batch_sizes=[1],
        layers=[
            LayerProfile(
                index=i,
                forward_s=[f],
                backward_s=[b],
                output_bytes=out_bytes,
                activation_bytes=act_bytes,
                param_bytes=param_bytes,
                optimizer_bytes=param_bytes,
            )
            for i in range(layers)
        ],
    )


def make_cost(
    slowdowns: dict[str, float],
    bandwidth: float = 1e18,
    profile: Profile | None = None,
    links: dict[str, float] | None = None,
) -> CostModel:
    """A cost model over devices named by `slowdowns`, all with one profile."""
    cluster = ClusterSpec(
        devices=[
            DeviceSpec(name=n, memory_bytes=8 << 30, slowdown=s) for n, s in slowdowns.items()
        ],
        bandwidth=bandwidth,
        links=links or {},
    )
    return CostModel({"ref": profile or make_profile()}, cluster)


def make_plan(
    stages: list[tuple[int, int, dict[str, int]]],
    global_batch: int,
    microbatches: int,
    warmups: list[int | None] | None = None,
) -> Plan:
    """A plan from (start, end, {device: share}) triples."""
    ks = warmups or [None] * len(stages)
    return Plan(
        stages=[
            StageSpec(
                start=lo,
                end=hi,
                devices=[Allocation(device=d, share=sh) for d, sh in devs.items()],
                warmup=k,
            )
            for (lo, hi, devs), k in zip(stages, ks, strict=True)
        ],
        global_batch=global_batch,
        microbatches=microbatches,
    )


# --- heterogeneous profiles and clusters (planner tests and benchmark) -------


def layered_profile(
    forward_s: list[float],
    out_bytes: list[int],
    act_bytes: list[int],
    param_bytes: list[int],
    batch_sizes: tuple[int, ...] = (1,),
    exponent: float = 1.0,
    backward_s: list[float] | None = None,
) -> Profile:
    """A model whose layer i takes forward_s[i] * b**exponent seconds on b samples.

    Backward takes backward_s[i] likewise (default: twice the forward); optimizer
    state equals the parameters.
    An `exponent` below 1 with several `batch_sizes` makes time sublinear in
    the batch, as measured profiles are.
    """
    backward = backward_s if backward_s is not None else [2 * f for f in forward_s]
    return Profile(
        model="synthetic-layered",
        device="ref",
        batch_sizes=list(batch_sizes),
        layers=[
            LayerProfile(
                index=i,
                forward_s=[f * b**exponent for b in batch_sizes],
                backward_s=[g * b**exponent for b in batch_sizes],
                output_bytes=o,
                activation_bytes=a,
                param_bytes=p,
                optimizer_bytes=p,
            )
            for i, (f, g, o, a, p) in enumerate(
                zip(forward_s, backward, out_bytes, act_bytes, param_bytes, strict=True)
            )
        ],
    )


def hetero_cost(
    devices: list[tuple[str, float, int]],
    profile: Profile,
    bandwidth: float = 12.5e6,
    links: dict[str, float] | None = None,
    latency_s: float = 0.0,
) -> CostModel:
    """A cost model over (name, slowdown, memory bytes) devices sharing `profile`."""
    cluster = ClusterSpec(
        devices=[DeviceSpec(name=n, memory_bytes=m, slowdown=s) for n, s, m in devices],
        bandwidth=bandwidth,
        links=links or {},
        latency_s=latency_s,
    )
    return CostModel({"ref": profile}, cluster)


def effnet_like_cost(layers: int = 200, seed: int = 0) -> CostModel:
    """An EfficientNet-B1-sized model (`layers` layers) on six Jetson-like devices.

    Layer costs are drawn from a seeded generator: feature maps (and so the
    bytes sent at a boundary) shrink with depth while parameters grow, as in a
    CNN. Devices mix Nano-, TX2- and NX-like speeds and 2-8 GiB budgets on a
    100 Mbps network.
    """
    import random

    rng = random.Random(seed)
    depth = [i / layers for i in range(layers)]
    profile = layered_profile(
        forward_s=[rng.uniform(0.05e-3, 0.6e-3) for _ in depth],
        out_bytes=[int(rng.choice((8, 16, 32, 64)) * 1024 * (1.05 - d)) for d in depth],
        act_bytes=[int(rng.randint(16, 160) * 1024 * (1.05 - d)) for d in depth],
        param_bytes=[int(rng.randint(1, 64) * 1024 * (0.1 + d) ** 2 * 8) for d in depth],
        batch_sizes=(1, 4, 16, 64),
        exponent=0.85,
    )
    gib = 1 << 30
    return hetero_cost(
        [
            ("nx-0", 1.0, 8 * gib),
            ("tx2-0", 1.8, 4 * gib),
            ("tx2-1", 1.8, 4 * gib),
            ("nano-0", 3.5, 2 * gib),
            ("nano-1", 3.5, 2 * gib),
            ("nano-2", 3.5, 2 * gib),
        ],
        profile,
        bandwidth=12.5e6,
    )
