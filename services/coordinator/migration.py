"""Which version recovery resumes from and who sends which layer, as pure functions.

After a loss, `survivors_plan` moves the partition points. Two questions remain
before training can go on without Redis: the one version every stage can
resume from (the consistent cut: a whole-lost stage lives on only in its
replicas), and, for every layer a device of the new plan does not hold yet,
which surviving device sends it. Sources are spread by bytes already assigned
so that the transfers run concurrently, peer to peer, rather than queueing at
one device. Everything here is deterministic: every run over the same inputs
gives the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

from common.ids import DeviceId
from common.plan import Plan, StageSpec
from services.coordinator.recovery import RecoveryImpossible

__all__ = ["Replica", "Transfers", "collect_plan", "cut_version", "transfers"]

_STAGE = 0
"""Rank of a holder that ran the layer in the old plan: preferred, its copy is live state."""
_REPLICA = 1
"""Rank of a holder that keeps the layer only as another device's backup."""


@dataclass(frozen=True)
class Replica:
    """A copy of one device's stage state at one version, kept by another device.

    Attributes:
        origin: The device whose stage state it is.
        start: First layer the copy holds.
        end: One past the last layer the copy holds.
        version: The weights after this many committed rounds.
        holder: The device that keeps the copy.

    """

    origin: DeviceId
    start: int
    end: int
    version: int
    holder: DeviceId


@dataclass(frozen=True)
class Transfers:
    """The layer moves that turn the survivors of an old plan into a new plan.

    Attributes:
        sources: Receiving device -> {layer: device that sends it}.
        sends: Sending device -> {receiving device: its layers, sorted}.
        moved: Number of (layer, receiver) transfers.
        moved_bytes: Bytes over all transfers.
        local: Device -> layers it takes from a replica it holds itself (no
            transfer, but it must promote its backup copy into its stage).

    """

    sources: dict[DeviceId, dict[int, DeviceId]]
    sends: dict[DeviceId, dict[DeviceId, list[int]]]
    moved: int
    moved_bytes: int
    local: dict[DeviceId, list[int]] = field(default_factory=dict)

    def sent_by(self, device: DeviceId) -> dict[DeviceId, list[int]]:
        """What `device` sends, by receiver; empty when it sends nothing."""
        return {d: list(layers) for d, layers in self.sends.get(device, {}).items()}

    def received_by(self, device: DeviceId) -> dict[int, DeviceId]:
        """Who sends `device` each layer it fetches; empty when it fetches nothing."""
        return dict(self.sources.get(device, {}))


def _orphaned(plan: Plan, lost: Set[DeviceId]) -> list[StageSpec]:
    """Stages whose whole group is lost: only replicas still have their state."""
    return [s for s in plan.stages if all(a.device in lost for a in s.devices)]


def _covered(stage: StageSpec, replicas: Iterable[Replica]) -> bool:
    """Whether `replicas` together hold every layer of `stage`."""
    missing = set(range(stage.start, stage.end))
    for r in replicas:
        missing.difference_update(range(r.start, r.end))
    return not missing


def cut_version(
    plan: Plan, lost: Set[DeviceId], committed: int, replicas: Iterable[Replica]
) -> int | None:
    """The newest version every stage can resume from without Redis, or None.

    A stage with a surviving device resumes at any version (its peers hold
    `committed`; older versions are the caller's job). A stage whose whole group
    is lost resumes only at a version its surviving replicas cover entirely, so
    the cut is the newest version, at most `committed`, at which every such stage
    is covered. Replicas newer than `committed` belong to an uncommitted round
    and never count. None means the job must fall back to Redis' checkpoint.
    """
    orphans = _orphaned(plan, lost)
    if not orphans:
        return committed
    usable = [r for r in replicas if r.holder not in lost and r.version <= committed]
    for version in sorted({r.version for r in usable}, reverse=True):
        at_version = [r for r in usable if r.version == version]
        if all(_covered(stage, at_version) for stage in orphans):
            return version
    return None


def _layer_count(plan: Plan, name: str) -> int:
    """Layers the plan's stages cover, which must be contiguous from layer 0."""
    expected = 0
    for i, stage in enumerate(plan.stages):
        if stage.start != expected or stage.end <= stage.start:
            raise RecoveryImpossible(
                f"{name} plan's stage {i} covers layers [{stage.start}, {stage.end}); "
                f"expected a non-empty range starting at {expected}"
            )
        expected = stage.end
    return expected


def _check_inputs(
    old: Plan, new: Plan, lost: Set[DeviceId], layer_bytes: Sequence[int] | None
) -> int:
    """The model's layer count, once the plans and sizes agree on it and `new` has no dead."""
    layers = _layer_count(old, "old")
    if _layer_count(new, "new") != layers:
        raise RecoveryImpossible(
            f"new plan covers {new.stages[-1].end} layers, old plan covers {layers}"
        )
    if layer_bytes is not None and len(layer_bytes) != layers:
        raise RecoveryImpossible(f"{len(layer_bytes)} layer sizes for a model of {layers} layers")
    dead = sorted(d for d in new.devices if d in lost)
    if dead:
        raise RecoveryImpossible(f"new plan places lost devices {', '.join(dead)}")
    return layers


def _holders(
    old: Plan, lost: Set[DeviceId], version: int, replicas: Iterable[Replica], layers: int
) -> list[dict[DeviceId, int]]:
    """Per layer, each surviving device holding it at `version` and its rank.

    A device that both ran the layer and keeps a replica of it ranks as a stage
    device, since its live copy is what it would send.
    """
    held: list[dict[DeviceId, int]] = [{} for _ in range(layers)]
    for r in replicas:
        if r.version == version and r.holder not in lost:
            for layer in range(max(r.start, 0), min(r.end, layers)):
                held[layer][r.holder] = _REPLICA
    for stage in old.stages:
        for a in stage.devices:
            if a.device not in lost:
                for layer in range(stage.start, stage.end):
                    held[layer][a.device] = _STAGE
    return held


def _pick(holders: dict[DeviceId, int], load: dict[DeviceId, int]) -> DeviceId:
    """The least loaded holder; then a stage device before a replica holder; then by name."""
    return min(holders, key=lambda h: (load.get(h, 0), holders[h], h))


def _missing_error(device: DeviceId, missing: list[int], version: int) -> RecoveryImpossible:
    """The error naming what `device` cannot fetch from anyone."""
    names = ", ".join(str(layer) for layer in missing)
    return RecoveryImpossible(
        f"device {device} needs layers {names} at version {version}, but no surviving "
        "device of the old plan and no surviving replica holds them"
    )


def _assign(
    device: DeviceId,
    stage: StageSpec,
    held: list[dict[DeviceId, int]],
    sizes: Sequence[int],
    load: dict[DeviceId, int],
    version: int,
) -> tuple[dict[int, DeviceId], list[int]]:
    """Sources for the layers of `stage` that `device` lacks, and those it has as a replica.

    `load` (bytes assigned per source so far) is updated in place so that the
    next receiver's choices see this one's.
    """
    fetched: dict[int, DeviceId] = {}
    own: list[int] = []
    missing: list[int] = []
    for layer in range(stage.start, stage.end):
        holders = held[layer]
        if device in holders:
            if holders[device] == _REPLICA:
                own.append(layer)
        elif not holders:
            missing.append(layer)
        else:
            source = _pick(holders, load)
            load[source] = load.get(source, 0) + sizes[layer]
            fetched[layer] = source
    if missing:
        raise _missing_error(device, missing, version)
    return fetched, own


def _by_sender(
    sources: dict[DeviceId, dict[int, DeviceId]],
) -> dict[DeviceId, dict[DeviceId, list[int]]]:
    """`sources` turned around: each sender's layers per receiver, all sorted."""
    sends: dict[DeviceId, dict[DeviceId, list[int]]] = {}
    for receiver in sorted(sources):
        for layer in sorted(sources[receiver]):
            sender = sources[receiver][layer]
            sends.setdefault(sender, {}).setdefault(receiver, []).append(layer)
    return {s: sends[s] for s in sorted(sends)}


def transfers(
    old: Plan,
    new: Plan,
    lost: Set[DeviceId],
    version: int,
    replicas: Iterable[Replica],
    layer_bytes: Sequence[int] | None = None,
) -> Transfers:
    """The peer-to-peer layer moves that give every device of `new` its layers at `version`.

    A surviving device keeps the layers its old stage ran; the rest come from a
    surviving device of the old stage that ran them or from a surviving holder
    of a replica at `version`, never from a lost device. Each layer goes to the
    source with the fewest bytes assigned so far, so the moves spread over all
    holders and run concurrently. Without `layer_bytes`, every layer counts 1.

    Raises:
        RecoveryImpossible: The plans cover different layer counts, `new` places
            a lost device, or a layer some device needs has no surviving holder
            (the message names the device and the layers).

    """
    layers = _check_inputs(old, new, lost, layer_bytes)
    sizes = list(layer_bytes) if layer_bytes is not None else [1] * layers
    held = _holders(old, lost, version, replicas, layers)
    stage_of = {a.device: stage for stage in new.stages for a in stage.devices}
    load: dict[DeviceId, int] = {}
    sources: dict[DeviceId, dict[int, DeviceId]] = {}
    local: dict[DeviceId, list[int]] = {}
    for device in sorted(stage_of):
        fetched, own = _assign(device, stage_of[device], held, sizes, load, version)
        if fetched:
            sources[device] = fetched
        if own:
            local[device] = own
    return Transfers(
        sources=sources,
        sends=_by_sender(sources),
        moved=sum(len(f) for f in sources.values()),
        moved_bytes=sum(sizes[layer] for f in sources.values() for layer in f),
        local=local,
    )


def collect_plan(
    old: Plan,
    lost: Set[DeviceId],
    version: int,
    replicas: Iterable[Replica],
    layer_bytes: Sequence[int] | None = None,
) -> dict[DeviceId, list[int]]:
    """Which surviving device writes which layer at `version` to the central store.

    The heavy recovery's gather (FTPipeHD's redistribution through the central
    node): every layer once, from a surviving device of its old stage or a
    replica holder, spread over holders by bytes like `transfers`.

    Raises:
        RecoveryImpossible: A layer has no surviving holder at `version`.

    """
    layers = old.stages[-1].end
    sizes = list(layer_bytes) if layer_bytes is not None else [1] * layers
    held = _holders(old, lost, version, replicas, layers)
    load: dict[DeviceId, int] = {}
    writes: dict[DeviceId, list[int]] = {}
    missing = [layer for layer in range(layers) if not held[layer]]
    if missing:
        raise _missing_error(DeviceId("the central store"), missing, version)
    for layer in range(layers):
        source = _pick(held[layer], load)
        load[source] = load.get(source, 0) + sizes[layer]
        writes.setdefault(source, []).append(layer)
    return {d: writes[d] for d in sorted(writes)}
