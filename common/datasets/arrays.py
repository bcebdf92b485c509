"""Arrays ``x`` and ``y`` from a ``.npz``, a folder of ``x.npy``/``y.npy``, or safetensors.

``x`` holds one row per sample in the model's input shape (floating for an
image model, integer token ids for a token model), ``y`` one integer label per
row. Only the rows of a batch are read: ``.npy`` files are memory-mapped,
safetensors rows are sliced lazily (``safe_open``). A ``.npz`` cannot be mapped,
so its ``x`` is read whole the first time a batch needs it. The labels are read
whole when the source opens (one integer per sample).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from common.errors import ConfigError
from common.zoo import InputSpec

__all__ = ["Arrays"]

_FLOAT_CODES = ("F", "BF")


class Arrays:
    """The arrays at `path`; the form follows the path (suffix or folder)."""

    def __init__(self, path: Path) -> None:
        self.name, self.path = str(path), path
        self._x: Any = None
        self._st: Any = None
        if path.is_dir():
            x_shape, x_float, y = self._open_npy(path)
        elif path.suffix == ".npz" and path.is_file():
            x_shape, x_float, y = self._open_npz(path)
        elif path.suffix == ".safetensors" and path.is_file():
            x_shape, x_float, y = self._open_safetensors(path)
        elif not path.exists():
            raise ConfigError(f"dataset.path: {path} does not exist")
        else:
            raise ConfigError(
                f"dataset.path: {path} is not a .npz, a .safetensors or a folder with x.npy, y.npy"
            )
        if len(x_shape) < 2:
            raise ConfigError(f"dataset.path: {path}: x has shape {x_shape}, want (samples, ...)")
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise ConfigError(
                f"dataset.path: {path}: y must be 1-D integers, got shape {y.shape} {y.dtype}"
            )
        if x_shape[0] != y.shape[0]:
            raise ConfigError(f"dataset.path: {path}: x has {x_shape[0]} rows, y has {y.shape[0]}")
        if not x_shape[0]:
            raise ConfigError(f"dataset.path: {path} holds no samples")
        self.sample_shape, self.floating = tuple(x_shape[1:]), x_float
        self._labels = torch.from_numpy(y.astype(np.int64))

    def _open_npy(self, path: Path) -> tuple[tuple[int, ...], bool, np.ndarray]:
        try:
            self._x = np.load(path / "x.npy", mmap_mode="r", allow_pickle=False)
            y = np.load(path / "y.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"dataset.path: {path} has no readable x.npy and y.npy: {exc}"
            ) from exc
        return self._x.shape, np.issubdtype(self._x.dtype, np.floating), np.asarray(y)

    def _open_npz(self, path: Path) -> tuple[tuple[int, ...], bool, np.ndarray]:
        try:
            with np.load(path, allow_pickle=False) as z:
                if "x" not in z.files or "y" not in z.files:
                    raise ConfigError(f"dataset.path: {path} lacks x or y (has {z.files[:5]})")
                y = z["y"]
                x_header = _npz_header(path)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise ConfigError(f"dataset.path: {path} is not a readable .npz: {exc}") from exc
        return x_header[0], np.issubdtype(x_header[1], np.floating), y

    def _open_safetensors(self, path: Path) -> tuple[tuple[int, ...], bool, np.ndarray]:
        try:
            self._st = safe_open(str(path), framework="pt")
            keys = set(self._st.keys())
            if not {"x", "y"} <= keys:
                raise ConfigError(f"dataset.path: {path} lacks tensor x or y")
            xs = self._st.get_slice("x")
            shape, code = tuple(xs.get_shape()), xs.get_dtype()
            y = self._st.get_tensor("y").numpy()
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise ConfigError(f"dataset.path: {path} is not readable safetensors: {exc}") from exc
        return shape, code.startswith(_FLOAT_CODES), y

    def __len__(self) -> int:
        return int(self._labels.numel())

    def check(self, want: InputSpec, num_classes: int) -> None:
        """Refuse a model whose input or classes this source cannot give."""
        if self.sample_shape != want.shape:
            raise ConfigError(
                f"dataset: {self.name}: x rows have shape {self.sample_shape}, "
                f"the model's input is {want.shape}"
            )
        if self.floating != (want.kind == "image"):
            have = "floating" if self.floating else "integer"
            need = "floating images" if want.kind == "image" else "integer token ids"
            raise ConfigError(f"dataset: {self.name}: x is {have}, the model wants {need}")
        top = int(self._labels.max())
        if int(self._labels.min()) < 0 or top >= num_classes:
            raise ConfigError(
                f"dataset: {self.name}: labels span [{int(self._labels.min())}, {top}], "
                f"the model has classes 0-{num_classes - 1}"
            )

    def _rows(self, rows: list[int]) -> torch.Tensor:
        if self._st is not None:
            xs = self._st.get_slice("x")
            parts = [xs[r : r + 1] for r in rows]
            return torch.cat(parts) if parts else torch.empty(0, *self.sample_shape)
        if self._x is None:  # a .npz: read once, when a batch first needs it
            with np.load(self.path, allow_pickle=False) as z:
                self._x = z["x"]
        return torch.from_numpy(np.ascontiguousarray(self._x[rows]))

    def read(self, rows: list[int], want: InputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of `rows` shaped for `want`, and their labels; no other row is read."""
        return self._rows(rows).to(want.dtype), self.read_labels(rows)

    def read_labels(self, rows: list[int]) -> torch.Tensor:
        """The int64 labels of `rows`."""
        return self._labels[torch.tensor(rows, dtype=torch.int64)]


def _npz_header(path: Path) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Shape and dtype of the npz's ``x`` from its .npy header, without reading the array."""
    with zipfile.ZipFile(path) as zf, zf.open("x.npy") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    return tuple(shape), dtype
