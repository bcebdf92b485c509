"""A device's measured block times: what a worker reports and the cost model reads.

The worker measures these (`services.worker.galaxy.profiling`) and sends them in
`BlocksProfiled`; the coordinator's planner and cost model consume them. Being on
the wire, the model lives with the other contracts rather than with either engine.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import pairwise

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["BlockProfile", "Points"]

Points = tuple[tuple[int, float], ...]


def _interpolate(points: Points, x: float) -> float:
    """Piecewise-linear through (0, 0) and `points`, extended by the last segment's slope."""
    xs = [0, *(p[0] for p in points)]
    ys = [0.0, *(p[1] for p in points)]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class BlockProfile(BaseModel):
    """Measured seconds of one device's blocks at a few partition sizes, for one seq_len.

    The planner and cost model need a block's time at any share, so between the
    measured sizes the time is interpolated linearly (and through 0 at 0).
    `*_open` / `*_close` are the shares of a block's time spent in its first and
    last GEMM: the parts tile overlap can hide ring steps under.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    seq_len: int = Field(ge=1)
    mha: Points = Field(description="(heads, seconds of the MHA block)")
    mlp: Points = Field(description="(MLP columns, seconds of the MLP block)")
    con: Points = Field(description="(rows, seconds of one connective block)")
    mha_open: float = Field(0.5, ge=0.0, le=1.0, description="Share in the QKV GEMM.")
    mha_close: float = Field(0.25, ge=0.0, le=1.0, description="Share in the output GEMM.")
    mlp_open: float = Field(0.5, ge=0.0, le=1.0, description="Share in the up GEMM.")
    mlp_close: float = Field(0.5, ge=0.0, le=1.0, description="Share in the down GEMM.")
    step_s: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="Seconds of the ring's own work per ring step on this device (framing, "
        "copies, thread wakeups), beyond the bytes on the link.",
    )
    layer_s: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="Seconds of Python and dispatch work per layer outside the timed blocks.",
    )

    @field_validator("mha", "mlp", "con")
    @classmethod
    def _increasing(cls, points: Points) -> Points:
        """Interpolation needs sizes > 0, strictly increasing, with times >= 0."""
        if not points:
            raise ValueError("needs at least one (size, seconds) point, got none")
        sizes = [p[0] for p in points]
        if sizes[0] < 1 or any(b <= a for a, b in pairwise(sizes)):
            raise ValueError(f"sizes must be >= 1 and strictly increasing, got {sizes}")
        if any(p[1] < 0 for p in points):
            raise ValueError(f"seconds must be >= 0, got {[p[1] for p in points]}")
        return points

    @model_validator(mode="after")
    def _shares(self) -> BlockProfile:
        """A block's first and last GEMM cannot take more than the whole block."""
        for block in ("mha", "mlp"):
            total = getattr(self, f"{block}_open") + getattr(self, f"{block}_close")
            if total > 1.0 + 1e-9:
                raise ValueError(f"{block}_open + {block}_close must be <= 1, got {total}")
        return self

    def mha_s(self, heads: float) -> float:
        """Seconds of the MHA block for `heads` heads."""
        return _interpolate(self.mha, heads)

    def mlp_s(self, cols: float) -> float:
        """Seconds of the MLP block for `cols` columns."""
        return _interpolate(self.mlp, cols)

    def con_s(self, rows: float) -> float:
        """Seconds of one connective block for `rows` rows."""
        return _interpolate(self.con, rows)
