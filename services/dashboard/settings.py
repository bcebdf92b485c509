"""The dashboard's settings: where it listens and when a silent device counts as down."""

from __future__ import annotations

from pydantic import Field

from common.settings import CommonSettings, CoordinatorSettings
from services.dashboard import DEFAULT_PORT

__all__ = ["DEFAULT_PORT", "DashboardSettings"]


class DashboardSettings(CommonSettings):
    """Settings of `asteroid-dashboard` (flags over ``ASTEROID_*`` variables)."""

    http_host: str = Field(
        "127.0.0.1",
        max_length=255,
        description="HTTP address to listen on (beyond loopback, anyone who reaches it reads "
        "the cluster's state).",
    )
    http_port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="HTTP port (0: any free).")
    stale_after_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="Seconds without a heartbeat after which a device shows as down (default: "
        "heartbeat_s times the coordinator's heartbeat_misses, when it suspects one).",
    )

    def stale_s(self) -> float:
        """`stale_after_s`, or when the coordinator starts suspecting a silent worker."""
        if self.stale_after_s is not None:
            return self.stale_after_s
        misses = CoordinatorSettings.model_fields["heartbeat_misses"].default
        return self.heartbeat_s * float(misses)
