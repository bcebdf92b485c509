"""Exception hierarchy for Asteroid-Edge.

Errors say what was expected and what was found, and name the offender (a
device, a field, a sender) so that a log line alone explains the failure.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable

from pydantic import BaseModel, ValidationError

__all__ = [
    "AsteroidError",
    "CheckpointError",
    "ConfigError",
    "DataPathError",
    "NonFiniteError",
    "PeerDataError",
    "PlanError",
    "ProtocolError",
    "RoundAbortedError",
    "RoundTimeoutError",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "Unreachable",
    "keys_at",
    "unreachable_for",
    "validation_message",
]


class AsteroidError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(AsteroidError):
    """A job spec, plan or setting is invalid."""


class DataPathError(ConfigError):
    """A job's dataset files cannot be used, said the same way whatever the reason.

    `common.job_data.train_size` and `eval_size` check a submitted job's ``dataset.path`` on the
    coordinator's disk; the submitter may be anyone with an operator key, and a
    reason (no such folder, no training files, unreadable) would tell them which
    paths exist there. So ``str()`` is one sentence and `detail` holds the reason,
    for the coordinator's own log.
    """

    PUBLIC = (
        "dataset.path: no readable dataset of this kind at that path on the coordinator "
        "(its log says why)"
    )

    def __init__(self, detail: str) -> None:
        super().__init__(self.PUBLIC)
        self.detail = detail


class PlanError(ConfigError):
    """A plan does not fit the model, the cluster or the batch."""


class ProtocolError(AsteroidError):
    """A message could not be decoded or violates the wire protocol.

    `kind` is the type tag of a message that decoded but failed validation, so a
    service can answer a malformed request of a kind it serves; None otherwise.
    `route` is then the connection it came on (a routed receive), to answer on.
    """

    def __init__(self, reason: str, sender: str = "?", kind: str | None = None) -> None:
        super().__init__(f"bad message from {sender}: {reason}")
        self.reason = reason
        self.sender = sender
        self.kind = kind
        self.route = b""


class StoreError(AsteroidError):
    """Shared state in Redis is missing or inconsistent."""


class Unreachable(AsteroidError):
    """The cluster did not answer: Redis or a coordinator, not there or not answering in time.

    One base for both, so every command and service maps it to one exit code
    (`common.exit_codes.ExitCode.UNREACHABLE`): the fix is the same (start it,
    or point the address at it), whichever of the two it was.
    """


class StoreUnavailable(StoreError, Unreachable):
    """Redis did not answer (or stayed unreachable longer than the service waits)."""


def unreachable_for(where: str, waited_s: float, what: str, patience_s: float, error: str) -> str:
    """Why a step gave up on Redis: where, how long, doing what, and Redis's last error.

    One wording for the store's own wait (`Store.ride_out`) and a job core's
    (`services.coordinator.store_outage`), so a person sees the same sentence.
    """
    return (
        f"Redis at {where} unreachable for {waited_s:.1f} s while {what} "
        f"(patience {patience_s:g} s): {error}"
    )


class StoreRefused(StoreError):
    """Redis answered but would not do a command: full (maxmemory), read-only, or denied.

    Unlike an outage, waiting does not help: the step that needed the write fails,
    naming Redis and its reason, and the service goes on.
    """


class CheckpointError(StoreError):
    """A checkpoint is missing, incomplete or does not match the model."""


class RoundAbortedError(AsteroidError):
    """The coordinator replaced the plan or stopped the worker while a round waited."""


class RoundTimeoutError(AsteroidError):
    """A peer did not deliver what a round needs within the configured timeout."""


class PeerDataError(AsteroidError):
    """A plan member sent a part that cannot be right (inf or nan, labels out of range).

    The part is refused and the round fails at once naming the peer, instead of
    training on poison or waiting for a part that will never come.
    """


class NonFiniteError(AsteroidError):
    """A worker's own computation (its loss, activations, gradients, weights) went inf or nan.

    The round fails before anything non-finite is sent or committed.
    """


def validation_message(
    exc: ValidationError,
    where_of: Callable[[tuple[int | str, ...]], str] | None = None,
    model: type[BaseModel] | None = None,
) -> str:
    """The first error of a pydantic ValidationError as "field.path: what is wrong".

    An unknown key comes first, whatever pydantic's order: a typo'd key is the
    cause of the "required but missing" beside it, so it is the one to name.
    With the `model` validated, an unknown key is said with the closest key
    that model takes there ("did you mean ..."). `where_of` names the place
    from the error's location (an inventory names the device, not its index);
    by default the dotted path, or "job".
    """
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")  # stable
    err = errors[0]
    loc = tuple(err["loc"])
    where = where_of(loc) if where_of else ".".join(str(p) for p in loc) or "job"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        missing = [
            e["loc"][-1] for e in errors if e["type"] == "missing" and e["loc"][:-1] == loc[:-1]
        ]
        msg = "unknown key" + _did_you_mean(loc, model, [str(m) for m in missing])
    elif err["type"] == "missing":
        msg = "required but missing"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {msg}{more}"


def _did_you_mean(
    loc: tuple[int | str, ...], model: type[BaseModel] | None, missing: list[str]
) -> str:
    """The hint after "unknown key": the closest key `model` takes at `loc`, or the keys.

    A key reported missing beside it is the likelier meaning (`modle` is `model`,
    not `mode`), so those are tried first.
    """
    if model is None or not loc or not isinstance(loc[-1], str):
        return ""
    known = keys_at(model, loc[:-1])
    close = difflib.get_close_matches(loc[-1], missing, n=1, cutoff=0.6)
    close = close or difflib.get_close_matches(loc[-1], sorted(known), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f"; known keys: {', '.join(sorted(known))}" if 0 < len(known) <= 12 else ""


def keys_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> set[str]:
    """The keys the mapping at `loc` inside `model` may hold (every union member's).

    A list index or a union member's tag in `loc` stays at the same mapping;
    a field name steps into the models its annotation names.
    """
    current = [model]
    for part in loc:
        inner = [
            sub
            for m in current
            if isinstance(part, str) and part in m.model_fields
            for sub in _models_in(m.model_fields[part].annotation)
        ]
        current = inner or current
    return {field.alias or name for m in current for name, field in m.model_fields.items()}


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models an annotation names, through unions, Annotated and containers."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
