"""Whether the replicas of a checkpoint's stages hold one state: a pure check on digests.

Apart from the checkpoint store so that the coordinator's pure core can refuse a
diverged checkpoint without importing Redis or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.errors import CheckpointError

__all__ = ["check_replicas"]


def check_replicas(round_no: int, digests: Sequence[Mapping[str, str]]) -> None:
    """Refuse checkpoint `round_no` when the replicas of a stage hold different state.

    Args:
        round_no: The checkpoint's round, for the error.
        digests: Per stage, each device's `stage_digest`.

    Raises:
        CheckpointError: Naming the first stage whose devices disagree, and who holds what.

    """
    for p, by_device in enumerate(digests):
        if len(set(by_device.values())) > 1:
            groups: dict[str, list[str]] = {}
            for device, digest in sorted(by_device.items()):
                groups.setdefault(digest, []).append(device)
            held = "; ".join(f"{', '.join(ds)} hold {d[:12]}" for d, ds in groups.items())
            raise CheckpointError(
                f"checkpoint round {round_no}: the replicas of stage {p} diverged, "
                f"expected one state, got {len(groups)} ({held})"
            )
