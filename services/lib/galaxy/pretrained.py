"""A person's model folder on disk (config.json plus safetensors), read slice by slice.

A Hugging Face-style folder is data, never code: only `config.json`, an
optional `model.safetensors.index.json` and the safetensors files it names
are read; no pickle (`*.bin`) is ever loaded and no remote code is run. Every
size the folder claims is held to the wire's bounds before anything is
allocated, each tensor's stored shape and dtype are checked before it is read,
and a device reads only the rows or columns of each tensor it keeps
(`sources.cut_of`) through safetensors' memory-mapped slices, so a shard of a
model too big for the device never passes through its memory whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from common.serving_messages import TransformerShape
from services.lib.galaxy.hf_layouts import Layout, Part, layout_of
from services.lib.galaxy.sources import cut_of
from services.lib.galaxy.weights import expected_shapes

__all__ = ["load_shard", "model_folder", "read_config", "read_shape"]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_BYTES = 1 << 20
"""Largest config.json read (real ones are a few KiB)."""
INDEX_BYTES = 64 << 20
"""Largest index read (a 70B model's is about 100 KiB)."""
MAX_TENSORS = 200_000
"""Most tensor names an index may list."""
MAX_NAME = 512
"""Longest tensor name an index may list."""
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\.safetensors$")
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_DTYPES = ("F32", "F16", "BF16")


def model_folder(path: str | Path) -> Path:
    """`path` as a folder of this machine, or a ConfigError saying that it is not one."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"model folder {str(path)!r} is not a directory on this device")
    return folder


def _read_json(file: Path, limit: int) -> dict[str, Any]:
    """A JSON object of at most `limit` bytes; the error names the file."""
    try:
        if file.stat().st_size > limit:
            raise ConfigError(f"{file} is larger than {limit} bytes")
        with file.open("rb") as f:
            value = json.loads(f.read(limit + 1))
    except FileNotFoundError:
        raise ConfigError(f"model folder {str(file.parent)!r} has no {file.name}") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ConfigError(f"cannot read {file}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{file} must hold a JSON object, got {type(value).__name__}")
    return value


def _layout(folder: Path) -> Layout:
    return layout_of(_read_json(folder / CONFIG_FILE, CONFIG_BYTES))


def read_config(path: str | Path) -> TransformerConfig:
    """The served config of the model in folder `path` (from its config.json only).

    Raises:
        ConfigError: No folder or config.json there, an unknown `model_type`, a
            variant we do not compute, or a size beyond the wire's bounds.

    """
    return _layout(model_folder(path)).config


def read_shape(path: str | Path) -> TransformerShape:
    """`read_config` as the wire's shape: what a serving spec's `model` is for this folder."""
    return TransformerShape.of(read_config(path))


def _differences(got: TransformerConfig, want: TransformerConfig) -> str:
    return ", ".join(
        f"{f.name} {getattr(got, f.name)!r} (planned {getattr(want, f.name)!r})"
        for f in fields(TransformerConfig)
        if getattr(got, f.name) != getattr(want, f.name)
    )


class _Tensors:
    """The folder's safetensors: which file holds each tensor, each opened once, on demand."""

    def __init__(self, folder: Path, stack: ExitStack) -> None:
        self.folder, self.stack = folder, stack
        self.files: dict[str, Any] = {}
        if (folder / INDEX_FILE).is_file():
            self.where = self._index()
        elif (folder / SINGLE_FILE).is_file():
            self.where = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            self._refuse()

    def _refuse(self) -> None:
        pickles = sorted({p.name for pattern in _PICKLES for p in self.folder.glob(pattern)})
        if pickles:
            raise ConfigError(
                f"model folder {str(self.folder)!r} holds its weights only as pickle files "
                f"({', '.join(pickles[:3])}), which can run code and are never loaded: convert "
                "them to safetensors (transformers: model.save_pretrained(folder, "
                "safe_serialization=True))"
            )
        raise ConfigError(
            f"model folder {str(self.folder)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}"
        )

    def _index(self) -> dict[str, str]:
        raw = _read_json(self.folder / INDEX_FILE, INDEX_BYTES).get("weight_map")
        if not isinstance(raw, dict) or not 1 <= len(raw) <= MAX_TENSORS:
            raise ConfigError(
                f"{INDEX_FILE} must map 1 to {MAX_TENSORS} tensor names to files in weight_map"
            )
        for name, file in raw.items():
            if len(name) > MAX_NAME or not isinstance(file, str) or not _FILE_NAME.match(file):
                raise ConfigError(
                    f"{INDEX_FILE} maps {name[:MAX_NAME]!r} to {str(file)[:MAX_NAME]!r}: a "
                    f"name of at most {MAX_NAME} characters must map to a .safetensors file "
                    "of this folder"
                )
        return raw

    def _open(self, file: str) -> Any:
        if file not in self.files:
            try:
                self.files[file] = self.stack.enter_context(
                    safe_open(str(self.folder / file), framework="pt")
                )
            except (OSError, SafetensorError) as exc:
                raise ConfigError(f"cannot read {file} of {str(self.folder)!r}: {exc}") from None
        return self.files[file]

    def __contains__(self, name: object) -> bool:
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def read(self, part: Part, rows: slice, cols: slice, ours: tuple[int, ...]) -> Tensor:
        """Our rows and columns of `part`, as float32 in `nn.Linear` orientation.

        `ours` is our whole tensor's shape, which the slices index.
        """
        if part.name not in self.where:
            raise ConfigError(f"model folder {str(self.folder)!r} lacks tensor {part.name!r}")
        file = self.where[part.name]
        try:
            stored = self._open(file).get_slice(part.name)
            dtype, shape = stored.get_dtype(), tuple(stored.get_shape())
        except SafetensorError as exc:
            raise ConfigError(f"{file} does not hold {part.name!r}: {exc}") from None
        if dtype not in _DTYPES:
            raise ConfigError(f"tensor {part.name!r} is {dtype}; served weights must be {_DTYPES}")
        if shape != part.shape:
            raise ConfigError(
                f"tensor {part.name!r} of {file} must have shape {part.shape} for this "
                f"config.json, got {shape}"
            )
        r0, r1, _ = rows.indices(ours[0])
        out = slice(part.offset + r0, part.offset + r1)
        t: Tensor
        if len(ours) == 1:
            t = stored[out]
        else:
            c0, c1, _ = cols.indices(ours[1])
            if part.first_row:
                t = stored[0:1, c0:c1]
            elif part.transposed:
                t = stored[c0:c1, out].T
            else:
                t = stored[out, c0:c1]
        return t.float().contiguous()


def load_shard(
    path: str | Path, config: TransformerConfig, heads: range, cols: range
) -> dict[str, Tensor]:
    """A device's shard of the folder's model: its `heads` and MLP `cols`, re-indexed from 0.

    Equal to `sources.shard(whole, config, heads, cols)` of the whole model's
    weights, but read tensor by tensor and slice by slice: the peak is the shard
    plus one tensor's slice. With every head and column it is the whole model.

    Raises:
        ConfigError: The folder's model is not `config` (naming each field that
            differs), or a tensor is missing, misshapen or of another dtype.

    """
    folder = model_folder(path)
    layout = _layout(folder)
    if layout.config != config:
        raise ConfigError(
            f"model folder {str(path)!r} holds another model than planned: "
            f"{_differences(layout.config, config)}"
        )
    weights: dict[str, Tensor] = {}
    with ExitStack() as stack:
        tensors = _Tensors(folder, stack)
        recipes = layout.recipes(tensors)
        for name, shape in expected_shapes(config).items():
            rows, columns = cut_of(name, config, heads, cols)
            if name not in recipes:  # a layout that forgot a tensor: a bug, said plainly
                raise ConfigError(f"{layout.config.kind} layout has no recipe for {name!r}")
            parts = [tensors.read(part, rows, columns, shape) for part in recipes[name]]
            total = parts[0]
            for more in parts[1:]:
                total = total + more
            weights[name] = total
    return weights
