"""Stage state a worker holds by version: its own snapshots, replicas, migrated layers.

Recovery resumes every stage from one version (DESIGN, "Fault tolerance"), so
a worker keeps, per layer, the state of its stage at the versions
the coordinator may pick: the start of the current round (a round in flight
may be abandoned after this device stepped) and the replication versions
named in `RunRound.keep`. A backup node keeps the replica of the stage it
backs up at those versions too. Layers migrated to this worker for a new plan
wait here, per sender, until the new stage takes them.

Replicas and migrated layers come from peers: each is taken only from the
device the plan names, only for the current plan epoch (replicas) or a newer
one (migrations may arrive before this worker's own Assign), and only while
the received bytes stay under the cap; anything else is refused with a
reason the receiver logs beside the sender.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.errors import CheckpointError, RoundAbortedError, RoundTimeoutError
from common.messages import LayerState

__all__ = ["HeldLayer", "Holdings", "ReplicaSource"]

_POLL_S = 0.2
"""Longest a wait sleeps before it looks at the abort flag again."""


class HeldLayer:
    """One layer's state at one version: copied tensors, safetensors bytes, or both.

    A round-start snapshot only copies tensors, which costs a memory copy;
    the bytes are made when the layer is first sent (a replica, a migration,
    a gather), so rounds that send nothing never serialise. A layer from a
    peer stays the bytes it came as until a stage loads it. A stage that takes
    over a layer it already holds loads the copied tensors, never bytes.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor] | None = None, blob: bytes | None = None
    ) -> None:
        if tensors is None and blob is None:
            raise ValueError("a held layer needs its tensors or its bytes")
        self._tensors = None if tensors is None else dict(tensors)
        self._blob = blob
        self._lock = threading.Lock()

    def blob(self) -> bytes:
        """The layer as one safetensors blob (made once, on first use)."""
        with self._lock:
            if self._blob is None:
                assert self._tensors is not None  # one of the two is always set
                self._blob = st_save(self._tensors)
            return self._blob

    def tensors(self) -> dict[str, torch.Tensor]:
        """New tensors of the layer, the caller's to keep and change (an optimizer steps them).

        Raises:
            CheckpointError: The bytes (they may come from a peer) are not valid
                safetensors; they are parsed, never executed.

        """
        if self._tensors is not None:
            return {name: t.clone() for name, t in self._tensors.items()}
        assert self._blob is not None
        try:
            return st_load(self._blob)
        except Exception as exc:  # safetensors raises its own error types for a bad blob
            raise CheckpointError(f"is not valid safetensors: {exc}") from exc


@dataclass(frozen=True)
class ReplicaSource:
    """The stage this worker backs up under the current plan: who sends it, which layers."""

    origin: str
    start: int
    end: int


class Holdings:
    """Thread-safe per-layer blobs by version, plus migrated layers awaiting their stage.

    Args:
        max_bytes: Most bytes of received replicas and migrated layers held at
            once (own snapshots are this worker's and never refused).
        on_replica: Called (outside the lock) with the version of a replica
            once every one of its layers arrived.

    """

    def __init__(self, max_bytes: int, on_replica: Callable[[ReplicaSource, int], None]) -> None:
        self.max_bytes = max_bytes
        self.on_replica = on_replica
        self.cond = threading.Condition()
        self.epoch = -1
        self.replica: ReplicaSource | None = None
        self._own: dict[int, dict[int, HeldLayer]] = {}
        self._replicas: dict[int, dict[int, bytes]] = {}
        self._migrated: dict[tuple[int, int], dict[str, bytes]] = {}

    # --- main thread ----------------------------------------------------------

    def reset(self, epoch: int, replica: ReplicaSource | None) -> None:
        """A new plan epoch: everything held before is gone (the new stage is built).

        Migrated layers of this epoch or later that arrived early are kept.
        """
        with self.cond:
            self.epoch, self.replica = epoch, replica
            self._own.clear()
            self._replicas.clear()
            self._migrated = {k: v for k, v in self._migrated.items() if k[0] >= epoch}

    def snapshot(self, version: int, layers: Mapping[int, HeldLayer]) -> None:
        """Keep this worker's own stage at `version`."""
        with self.cond:
            self._own[version] = dict(layers)

    def keep_only(self, versions: Iterable[int]) -> None:
        """Drop own snapshots and replicas of every version not in `versions`."""
        keep = set(versions)
        with self.cond:
            self._own = {v: b for v, b in self._own.items() if v in keep}
            self._replicas = {v: b for v, b in self._replicas.items() if v in keep}

    def get(self, version: int, layer: int) -> HeldLayer | None:
        """`layer` at `version`, from an own snapshot or a complete replica."""
        with self.cond:
            own = self._own.get(version, {}).get(layer)
            if own is not None:
                return own
            blob = self._replicas.get(version, {}).get(layer)
        return None if blob is None else HeldLayer(blob=blob)

    def versions(self) -> dict[str, list[int]]:
        """Versions held, own and replica, for logs and tests."""
        with self.cond:
            return {"own": sorted(self._own), "replica": sorted(self._replicas)}

    def take_migrated(
        self,
        epoch: int,
        sources: Mapping[int, str],
        timeout_s: float,
        aborted: Callable[[], str | None],
    ) -> dict[int, bytes]:
        """Wait for every layer of `sources` (layer -> sender) of plan epoch `epoch`.

        Raises:
            RoundTimeoutError: Layers still missing after `timeout_s`, naming them
                and their senders.
            RoundAbortedError: `aborted()` gave a reason (a newer command, a stop).

        """
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                missing = {
                    layer: sender
                    for layer, sender in sources.items()
                    if sender not in self._migrated.get((epoch, layer), {})
                }
                if not missing:
                    return {
                        layer: self._migrated.pop((epoch, layer))[sender]
                        for layer, sender in sources.items()
                    }
                reason = aborted()
                if reason is not None:
                    raise RoundAbortedError(reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    named = ", ".join(f"{layer} from {s}" for layer, s in sorted(missing.items()))
                    raise RoundTimeoutError(
                        f"plan epoch {epoch}: layers not received in {timeout_s:.0f} s: {named}"
                    )
                self.cond.wait(min(left, _POLL_S))

    # --- receiver thread ------------------------------------------------------

    def put(self, msg: LayerState, blob: bytes, sender: str) -> str | None:
        """Take a layer from `sender`; returns why it was refused, or None."""
        complete: ReplicaSource | None = None
        with self.cond:
            if self._received() + len(blob) > self.max_bytes:
                return (
                    f"{len(blob)} bytes would take received state past its cap of {self.max_bytes}"
                )
            if msg.purpose == "migrate":
                if msg.epoch < self.epoch:
                    return f"plan epoch {msg.epoch} is older than the current {self.epoch}"
                self._migrated.setdefault((msg.epoch, msg.layer), {})[sender] = blob
                self.cond.notify_all()
                return None
            why = self._refuse_replica(msg, sender)
            if why is not None:
                return why
            layers = self._replicas.setdefault(msg.version, {})
            layers[msg.layer] = blob
            src = self.replica
            assert src is not None  # checked by _refuse_replica
            if all(layer in layers for layer in range(src.start, src.end)):
                complete = src
        if complete is not None:
            self.on_replica(complete, msg.version)
        return None

    def _refuse_replica(self, msg: LayerState, sender: str) -> str | None:
        """Why a replica layer does not fit the current plan (under `cond`), or None."""
        if msg.epoch != self.epoch:
            return f"plan epoch {msg.epoch}, current is {self.epoch}"
        src = self.replica
        if src is None:
            return "this device backs up no stage under the current plan"
        if sender != src.origin:
            return f"replicas come from {src.origin!r}, not from {sender!r}"
        if (msg.start, msg.end) != (src.start, src.end) or not src.start <= msg.layer < src.end:
            return (
                f"layer {msg.layer} of [{msg.start}, {msg.end}) is not of the stage "
                f"backed up here, [{src.start}, {src.end})"
            )
        return None

    def _received(self) -> int:
        """Bytes of replicas and migrated layers held (under `cond`)."""
        held = sum(len(b) for layers in self._replicas.values() for b in layers.values())
        return held + sum(len(b) for by in self._migrated.values() for b in by.values())
