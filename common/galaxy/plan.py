"""How one request's Transformer inference is split over a ring of devices.

A plan is data: the planner writes it, the cost model prices it and the
executor runs it. Four modes share one shape so that all four can be compared
on the same cost model:

- `galaxy`: hybrid model parallelism (Galaxy §III-B). Device `d` runs heads
  `head_range(d)` and MLP columns `col_range(d)` (disjoint, in ring order) and
  the connective blocks on sequence rows `row_range(d)` (disjoint).
- `megatron`: tensor parallelism (Megatron-LM) with even head and column splits;
  the connective blocks are replicated, so every device runs all `seq_len`
  rows: `rows == [seq_len] * D` and `row_range(d)` is the whole sequence.
- `sp`: sequence parallelism; weights are replicated, so every device runs all
  heads and columns (`heads == [config.heads] * D`, `cols == [config.ffn] * D`
  and `head_range(d)` / `col_range(d)` are the whole model) on its rows.
- `local`: one device runs everything.

So `rows[d]` always means "rows device `d` runs the connective block on", and
a replicated dimension is written as the full count on every device.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig

__all__ = ["InferencePlan", "Mode"]

Mode = Literal["galaxy", "megatron", "sp", "local"]


class InferencePlan(BaseModel):
    """Per-device shares of heads, MLP columns and sequence rows, in ring order."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    mode: Mode
    devices: list[str] = Field(min_length=1, description="Device names in ring order.")
    heads: list[int] = Field(description="Attention heads per device.")
    cols: list[int] = Field(description="MLP columns per device.")
    rows: list[int] = Field(description="Sequence rows per device for the connective block.")
    seq_len: int = Field(ge=1, description="Tokens of the request the plan was made for.")
    overlap: bool = Field(False, description="Overlap ring steps with tile GEMMs (galaxy only).")

    @model_validator(mode="after")
    def _consistent(self) -> InferencePlan:
        """Refuse shapes that are wrong whatever the model: the fields must line up."""
        n = len(self.devices)
        for name in ("heads", "cols", "rows"):
            values: list[int] = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries, expected {n} (one per device)")
            if any(v < 0 for v in values):
                raise ValueError(f"{name} must be >= 0 per device, got {values}")
        if len(set(self.devices)) != n:
            raise ValueError(f"device names must be unique, got {self.devices}")
        if self.mode == "local" and n != 1:
            raise ValueError(f"a local plan has exactly 1 device, got {n}")
        if self.overlap and self.mode != "galaxy":
            raise ValueError(f"overlap is a galaxy-mode optimisation, mode is {self.mode!r}")
        return self

    @property
    def weights_replicated(self) -> bool:
        """Whether every device holds every head and column (sp, local)."""
        return self.mode in ("sp", "local")

    @property
    def rows_replicated(self) -> bool:
        """Whether every device runs the connective block on all rows (megatron, local)."""
        return self.mode in ("megatron", "local")

    def check(self, config: TransformerConfig) -> None:
        """Refuse a plan that does not cover `config` exactly once per split dimension.

        Under grouped-query attention a device's heads must also be whole KV groups.

        Raises:
            ConfigError: Naming the field, the expected total and the actual one.

        """
        if self.seq_len > config.max_positions:
            raise ConfigError(
                f"seq_len {self.seq_len} exceeds the model's max_positions {config.max_positions}"
            )
        totals = {"heads": config.heads, "cols": config.ffn, "rows": self.seq_len}
        for name, total in totals.items():
            values: list[int] = getattr(self, name)
            replicated = self.rows_replicated if name == "rows" else self.weights_replicated
            if replicated:
                if any(v != total for v in values):
                    raise ConfigError(
                        f"{self.mode} plan: {name} must be {total} on every device, got {values}"
                    )
            elif sum(values) != total:
                raise ConfigError(
                    f"{self.mode} plan: {name} must sum to {total}, got {sum(values)} ({values})"
                )
        group = config.group_size
        cut = [d for d, n in zip(self.devices, self.heads, strict=True) if n % group]
        if cut and not self.weights_replicated:
            raise ConfigError(
                f"{self.mode} plan: heads {self.heads} cut a key/value group of {group} query "
                f"heads on {cut}; each device's heads must be a multiple of {group}"
            )

    def head_range(self, i: int) -> range:
        """Heads device `i` computes (the whole model when weights are replicated)."""
        return self._range(self.heads, i, self.weights_replicated)

    def col_range(self, i: int) -> range:
        """MLP columns device `i` computes (the whole model when weights are replicated)."""
        return self._range(self.cols, i, self.weights_replicated)

    def row_range(self, i: int) -> range:
        """Sequence rows device `i` runs the connective block on."""
        return self._range(self.rows, i, self.rows_replicated)

    def _range(self, values: list[int], i: int, replicated: bool) -> range:
        if not 0 <= i < len(values):
            raise ConfigError(f"device index must be in [0, {len(values)}), got {i}")
        if replicated:
            return range(values[i])
        start = [0, *accumulate(values)][i]
        return range(start, start + values[i])
