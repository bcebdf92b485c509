"""The gateway's settings: where it listens, who may call it, and how much it takes at once."""

from __future__ import annotations

import hmac
from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from common.errors import ConfigError
from common.ids import check_job_id
from common.settings import CommonSettings
from common.units import Bytes

__all__ = ["MAX_QUEUE", "GatewaySettings", "key_matches"]

MAX_QUEUE = 16
"""Most requests the gateway may admit at once: the coordinator keeps at most 16 waiting per
requester key (`services.coordinator.infer_requests`), and the gateway is one requester."""
MAX_KEY_FILE_BYTES = 64 << 10
"""Longest API key file read."""


class GatewaySettings(CommonSettings):
    """Settings of `asteroid-gateway` (flags over ``ASTEROID_*`` variables)."""

    http_host: str = Field("127.0.0.1", max_length=255, description="HTTP address to listen on.")
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP port to listen on.")
    api_key: SecretStr | None = Field(
        None,
        description="Key HTTP clients send as `Authorization: Bearer KEY` (prefer the "
        "variable ASTEROID_API_KEY or --api-key-file: a flag shows in `ps`).",
    )
    api_key_file: Path | None = Field(
        None, description="File holding accepted API keys, one per line."
    )
    serve_id: str | None = Field(
        None, description="The serving job to answer with (default: the running one)."
    )
    model_dir: Path | None = Field(
        None,
        description="Model folder holding tokenizer.json and the chat template (default: "
        "the serving spec's `path`).",
    )
    model_name: str | None = Field(
        None, max_length=256, description="Model name /v1/models lists (default: the serve id)."
    )
    operator: str | None = Field(
        None,
        description="Operator key of --keys to reach the coordinator as (default: the "
        "key set's only one).",
    )
    max_body_bytes: Bytes = Field(
        1 << 20, gt=0, le=64 << 20, description="Largest HTTP request body (bytes, or like 1MiB)."
    )
    max_requests: int = Field(
        8,
        ge=1,
        le=MAX_QUEUE,
        description="Requests admitted at once (running or waiting at the coordinator); "
        "beyond, a request is refused at once with 429.",
    )
    request_timeout_s: float = Field(
        300.0, gt=0, le=3600, description="Longest one request may wait and run (504 past it)."
    )
    default_max_tokens: int = Field(
        256, ge=1, le=1024, description="Tokens a chat generates when it does not say."
    )

    @model_validator(mode="after")
    def _checked(self) -> GatewaySettings:
        if self.serve_id is not None:
            try:
                check_job_id(self.serve_id, "--serve-id")
            except ConfigError as exc:  # pydantic reports a ValueError as the flag's error
                raise ValueError(str(exc)) from None
        return self

    def api_keys(self) -> list[str]:
        """Every accepted key: --api-key and the lines of --api-key-file; [] for none."""
        keys = [self.api_key.get_secret_value()] if self.api_key is not None else []
        if self.api_key_file is not None:
            try:
                size = self.api_key_file.stat().st_size
                if size > MAX_KEY_FILE_BYTES:
                    raise ConfigError(f"--api-key-file {self.api_key_file} is {size} bytes")
                lines = self.api_key_file.read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"--api-key-file {self.api_key_file}: {exc}") from None
            keys += [line.strip() for line in lines if line.strip()]
        return [k for k in keys if k]


def key_matches(given: str, keys: list[str]) -> bool:
    """Whether `given` is one of `keys`, compared in constant time."""
    return any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)
