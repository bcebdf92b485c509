"""Profiles in Redis: where each one is stored and when a stored one is reused.

A profile lives under ``profile:<model key>:<device fingerprint>``, and the hash
``profiles:<model key>`` maps each device to when its profile was measured, so
that readers list a model's devices without scanning keys. The one-shot command
and the service both go through here, so they agree on the place and the rule.
"""

from __future__ import annotations

from pydantic import ValidationError

from common.logging import get_logger
from common.profile import Profile
from common.store import Store

__all__ = ["load_reusable", "profile_key", "save"]

log = get_logger(__name__)


def profile_key(model: str, device: str) -> str:
    """The ``<key>`` of ``profile:<key>``, as `ProfileReply` and the planner name a profile."""
    return f"{model}:{device}"


def load_reusable(store: Store, model: str, device: str, wanted: list[int]) -> Profile | None:
    """The stored profile of `model` on `device`, if valid and measured at every `wanted` size.

    Extra batch sizes do no harm (the planner reads the ones it needs); empty
    `wanted` accepts any stored profile.
    """
    data = store.get_json("profile", profile_key(model, device))
    if data is None:
        return None
    try:
        prof = Profile.model_validate(data)
    except ValidationError as exc:
        log.warning("stored profile is invalid; measuring again", error=str(exc).splitlines()[0])
        return None
    missing = sorted(set(wanted) - set(prof.batch_sizes))
    if missing:
        log.info("stored profile lacks batch sizes", stored=prof.batch_sizes, missing=missing)
        return None
    return prof


def save(store: Store, prof: Profile) -> str:
    """Store `prof` where readers look for it; returns its `profile_key`."""
    key = profile_key(prof.model, prof.device)
    store.put_json(prof.model_dump(mode="json"), "profile", key)
    store.set_fields({prof.device: prof.created}, "profiles", prof.model)
    return key
