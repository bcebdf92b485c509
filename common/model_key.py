"""The name a model's profiles are stored under.

Profiles are cached per (model key, device fingerprint): the profiler writes
them under this key and the coordinator looks them up by it before asking for
a new measurement, so both must derive it the same way; hence it lives here.
"""

from __future__ import annotations

from common.zoo import ModelSpec

__all__ = ["model_key"]


def model_key(spec: ModelSpec) -> str:
    """A stable name for a model's shape: zoo name, class count, sorted options."""
    opts = [f"num_classes={spec.num_classes}"]
    opts += [f"{k}={v!r}" for k, v in sorted(spec.options.items())]
    return f"{spec.name}({','.join(opts)})"
