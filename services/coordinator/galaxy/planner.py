"""Galaxy's heterogeneity- and memory-aware workload planner (Algorithm 1) and its baselines.

Algorithm 1 splits heads and MLP columns in proportion to each device's
capacity `V_d = 1 / (L(MHA, all heads, d) + L(MLP, all columns, d))` (Eq. 6),
then moves the overflow of out-of-memory devices to devices with room, in
proportion to their capacity, MLP first (finer grained) and then MHA. The
connective block's rows are split evenly (§III-C2). Heads move in whole KV
groups (grouped-query attention: the query heads that share one key/value
head stay on one device), so a group is the MHA block's unit. The baselines are the
paper's: Megatron-LM (even TP, replicated connective blocks), sequence
parallelism (replicated weights) and the single best device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from common.errors import ConfigError, PlanError
from common.galaxy.config import TransformerConfig
from common.galaxy.plan import InferencePlan
from common.galaxy.profile import BlockProfile
from services.coordinator.galaxy.cost import device_memory_bytes, memory_bytes

__all__ = [
    "balanced_partition",
    "capacities",
    "fits",
    "plan_galaxy",
    "plan_local",
    "plan_megatron",
    "plan_sp",
    "require_capacity",
    "require_fit",
]

MiB = 1 << 20


def balanced_partition(total: int, weights: Sequence[float]) -> list[int]:
    """`total` units split in proportion to `weights`, rounded so the sum stays exact.

    Largest-remainder rounding: everyone gets the floor of their quota, and the
    units left go to the largest fractional parts (ties to the larger weight, then
    the earlier device), so no device is ever more than one unit off its quota.

    Raises:
        ConfigError: If `total` is negative or the weights are empty, negative or all 0.

    """
    if total < 0:
        raise ConfigError(f"cannot split a negative total, got {total}")
    if not weights or any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise ConfigError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    s = sum(weights)
    quotas = [total * w / s for w in weights]
    shares = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (shares[i] - quotas[i], -weights[i], i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares


def capacities(config: TransformerConfig, profiles: Sequence[BlockProfile]) -> list[float]:
    """Eq. 6: each device's computing capacity, the inverse of its whole MHA + MLP time.

    Raises:
        ConfigError: If a profile predicts no time at all for the whole blocks.

    """
    out = []
    for p in profiles:
        seconds = p.mha_s(config.heads) + p.mlp_s(config.ffn)
        if not seconds > 0:
            raise ConfigError(f"profile of {p.device!r} gives {seconds} s for a whole layer")
        out.append(1.0 / seconds)
    return out


def fits(
    plan: InferencePlan, config: TransformerConfig, budgets: Mapping[str, int], dtype_bytes: int = 4
) -> list[str]:
    """One message per device of `plan` that runs out of memory; empty when it fits.

    Lets a benchmark report a baseline as OOM instead of failing on it.

    Raises:
        ConfigError: If a device has no budget.

    """
    missing = [d for d in plan.devices if d not in budgets]
    if missing:
        raise ConfigError(f"no memory budget for devices {missing}; have {sorted(budgets)}")
    needs = memory_bytes(plan, config, dtype_bytes)
    return [
        _shortfall(name, need, budgets[name])
        for name, need in zip(plan.devices, needs, strict=True)
        if need > budgets[name]
    ]


def require_fit(
    plan: InferencePlan, config: TransformerConfig, budgets: Mapping[str, int], dtype_bytes: int = 4
) -> None:
    """Refuse a plan some device cannot hold.

    Raises:
        PlanError: Naming each device, what it needs and what it has, in MiB.

    """
    problems = fits(plan, config, budgets, dtype_bytes)
    if problems:
        raise PlanError(f"{plan.mode} plan does not fit: " + "; ".join(problems))


def require_capacity(
    config: TransformerConfig, budgets: Mapping[str, int], seq_len: int, dtype_bytes: int = 4
) -> None:
    """Refuse a model that no split over these devices can hold, before anyone profiles it.

    Every device holds the embeddings and head whole (and one layer's working
    memory); the heads and MLP columns are what is split. If even all the
    room the budgets leave above that cannot take them, no plan fits, and
    timing the blocks on the devices would only waste their memory.

    Raises:
        PlanError: Naming what the model needs and what the devices have, in MiB.

    """
    fixed = device_memory_bytes(config, seq_len, 0, 0, 0, dtype_bytes=dtype_bytes)
    whole = device_memory_bytes(
        config, seq_len, config.heads, config.ffn, seq_len, dtype_bytes=dtype_bytes
    )
    room = sum(max(0, b - fixed) for b in budgets.values())
    if whole - fixed > room:
        have = ", ".join(f"{d} {b // MiB} MiB" for d, b in sorted(budgets.items()))
        raise PlanError(
            f"no split fits: the model's layers need {math.ceil((whole - fixed) / MiB)} MiB "
            f"beyond the {math.ceil(fixed / MiB)} MiB every device holds whole, and the "
            f"devices have {room // MiB} MiB above that ({have})"
        )


def _shortfall(name: str, need: int, has: int) -> str:
    # need rounded up and budget down, so the message never reads "needs 700, has 700"
    return f"{name} needs {math.ceil(need / MiB)} MiB, has {has // MiB} MiB"


@dataclass
class _Balancer:
    """The memory state Algorithm 1's MemoryAwareBalancing works on."""

    config: TransformerConfig
    seq_len: int
    heads: list[int]
    cols: list[int]
    rows: list[int]
    budgets: list[int]
    v: list[float]
    dtype_bytes: int
    group: int = 1
    """Query heads per KV group: heads move in multiples of it."""

    def need(self, d: int, heads: int | None = None, cols: int | None = None) -> int:
        return device_memory_bytes(
            self.config,
            self.seq_len,
            self.heads[d] if heads is None else heads,
            self.cols[d] if cols is None else cols,
            self.rows[d],
            dtype_bytes=self.dtype_bytes,
        )

    def overflow(self, d: int, block: Literal["mha", "mlp"]) -> int:
        """Fewest units (KV groups, MLP columns) of `block` device `d` must shed to fit.

        All of them if that fails.
        """
        shares = self.heads if block == "mha" else self.cols
        unit = self.group if block == "mha" else 1
        lo, hi = 0, shares[d] // unit
        while lo < hi:
            k = (lo + hi) // 2
            kept = shares[d] - k * unit
            need = self.need(d, heads=kept) if block == "mha" else self.need(d, cols=kept)
            if need <= self.budgets[d]:
                hi = k
            else:
                lo = k + 1
        return lo

    def balance(self, block: Literal["mha", "mlp"], active: list[int]) -> None:
        """MemoryAwareBalancing(T, C, V, L), recursing until no device in L is out of memory."""
        shares = self.heads if block == "mha" else self.cols
        unit = self.group if block == "mha" else 1
        oom = [d for d in active if self.need(d) > self.budgets[d]]
        free = [d for d in active if self.need(d) < self.budgets[d]]
        if not oom:
            return
        for o in oom:
            waiting = self.overflow(o, block)
            if free and waiting:
                moved = balanced_partition(waiting, [self.v[f] for f in free])
                for f, units in zip(free, moved, strict=True):
                    shares[f] += units * unit
                shares[o] -= waiting * unit
            active = [d for d in active if d != o]
        self.balance(block, active)


def plan_galaxy(
    config: TransformerConfig,
    devices: Sequence[str],
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
    seq_len: int,
    *,
    overlap: bool = True,
    dtype_bytes: int = 4,
) -> InferencePlan:
    """Algorithm 1: capacity-proportional heads and columns, rebalanced for memory.

    Raises:
        ConfigError: If a device lacks a profile or budget.
        PlanError: If devices remain out of memory after rebalancing (the
            algorithm's "Exit with Fail"), naming each and its shortfall.

    """
    _require(devices, seq_len)
    names = list(devices)
    missing = [d for d in names if d not in profiles or d not in budgets]
    if missing:
        raise ConfigError(f"every device needs a profile and a budget; missing for {missing}")
    v = capacities(config, [profiles[d] for d in names])
    bal = _Balancer(
        config=config,
        seq_len=seq_len,
        heads=_group_partition(config, v),
        cols=balanced_partition(config.ffn, v),
        rows=balanced_partition(seq_len, [1.0] * len(names)),
        budgets=[budgets[d] for d in names],
        v=v,
        dtype_bytes=dtype_bytes,
        group=config.group_size,
    )
    everyone = list(range(len(names)))
    bal.balance("mlp", everyone)
    bal.balance("mha", everyone)
    plan = InferencePlan(
        mode="galaxy",
        devices=names,
        heads=bal.heads,
        cols=bal.cols,
        rows=bal.rows,
        seq_len=seq_len,
        overlap=overlap and len(names) > 1,
    )
    plan.check(config)
    require_fit(plan, config, budgets, dtype_bytes)
    return plan


def plan_megatron(
    config: TransformerConfig,
    devices: Sequence[str],
    seq_len: int,
    budgets: Mapping[str, int] | None = None,
    dtype_bytes: int = 4,
) -> InferencePlan:
    """Megatron-LM: even head (in KV groups) and column splits, every device runs all rows.

    Raises:
        PlanError: If `budgets` is given and some device cannot hold its share.

    """
    _require(devices, seq_len)
    even = [1.0] * len(devices)
    plan = InferencePlan(
        mode="megatron",
        devices=list(devices),
        heads=_group_partition(config, even),
        cols=balanced_partition(config.ffn, even),
        rows=[seq_len] * len(devices),
        seq_len=seq_len,
    )
    return _checked(plan, config, budgets, dtype_bytes)


def plan_sp(
    config: TransformerConfig,
    devices: Sequence[str],
    seq_len: int,
    budgets: Mapping[str, int] | None = None,
    dtype_bytes: int = 4,
) -> InferencePlan:
    """Sequence parallelism: the whole model on every device, the rows split evenly.

    Raises:
        PlanError: If `budgets` is given and some device cannot hold the whole model.

    """
    _require(devices, seq_len)
    n = len(devices)
    plan = InferencePlan(
        mode="sp",
        devices=list(devices),
        heads=[config.heads] * n,
        cols=[config.ffn] * n,
        rows=balanced_partition(seq_len, [1.0] * n),
        seq_len=seq_len,
    )
    return _checked(plan, config, budgets, dtype_bytes)


def plan_local(
    config: TransformerConfig,
    devices: Sequence[str],
    profiles: Mapping[str, BlockProfile],
    budgets: Mapping[str, int],
    seq_len: int,
    dtype_bytes: int = 4,
) -> InferencePlan:
    """The single device that holds the whole model and runs it fastest.

    Raises:
        PlanError: If no device can hold the model, naming each one's shortfall.

    """
    _require(devices, seq_len)
    best: tuple[float, InferencePlan] | None = None
    problems: list[str] = []
    for name in devices:
        plan = InferencePlan(
            mode="local",
            devices=[name],
            heads=[config.heads],
            cols=[config.ffn],
            rows=[seq_len],
            seq_len=seq_len,
        )
        plan.check(config)
        oom = fits(plan, config, budgets, dtype_bytes)
        if oom:
            problems.extend(oom)
            continue
        if name not in profiles:
            raise ConfigError(f"no block profile for device {name!r}; have {sorted(profiles)}")
        p = profiles[name]
        seconds = p.mha_s(config.heads) + p.mlp_s(config.ffn) + 2 * p.con_s(seq_len)
        if best is None or seconds < best[0]:
            best = (seconds, plan)
    if best is None:
        raise PlanError("no single device holds the model: " + "; ".join(problems))
    return best[1]


def _group_partition(config: TransformerConfig, weights: Sequence[float]) -> list[int]:
    """Heads split in proportion to `weights` in whole KV groups (one head each without GQA)."""
    return [g * config.group_size for g in balanced_partition(config.kv_groups, weights)]


def _checked(
    plan: InferencePlan,
    config: TransformerConfig,
    budgets: Mapping[str, int] | None,
    dtype_bytes: int,
) -> InferencePlan:
    plan.check(config)
    if budgets is not None:
        require_fit(plan, config, budgets, dtype_bytes)
    return plan


def _require(devices: Sequence[str], seq_len: int) -> None:
    if not devices or len(set(devices)) != len(devices):
        raise ConfigError(f"a plan needs one or more distinct devices, got {list(devices)}")
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
