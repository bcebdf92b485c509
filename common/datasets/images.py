"""Image decoding and the image-folder kind (one sub-folder per class).

Decoding (Pillow) turns any image into the model's input: converted to RGB, or
to grey ("L") for a one-channel model, resized with bilinear filtering to the
model's height and width (no crop: the aspect ratio follows the model's),
scaled to [0, 1] and normalised ``(value - mean) / std`` per channel. Listing a
folder reads names only; a file is opened when a batch needs its sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ConfigError
from common.extras import require
from common.zoo import InputSpec

__all__ = ["IMAGE_SUFFIXES", "ImageFolder", "Normalise", "check_image_model", "to_input"]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
"""File suffixes (any case) an image folder's samples have; other files are ignored."""


class Normalise:
    """Per-channel ``(value - mean) / std``; one value stands for every channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = tuple(mean), tuple(std)

    def per_channel(self, channels: int, values: tuple[float, ...], what: str) -> torch.Tensor:
        """`values` as a ``(channels, 1, 1)`` tensor; ConfigError if their count fits neither."""
        if len(values) not in (1, channels):
            raise ConfigError(
                f"dataset.{what}: {len(values)} values for a model of {channels} channels "
                f"(give 1 or {channels})"
            )
        full = values * channels if len(values) == 1 else values
        return torch.tensor(full, dtype=torch.float32).view(channels, 1, 1)


def check_image_model(want: InputSpec, num_classes: int, classes: int, name: str) -> None:
    """Refuse a model that does not take (1 or 3, H, W) float images of at least `classes`."""
    if want.kind != "image" or len(want.shape) != 3 or want.shape[0] not in (1, 3):
        raise ConfigError(
            f"dataset: {name} holds images; the model wants {want.kind} input of shape "
            f"{want.shape} (an image model takes (1 or 3, height, width))"
        )
    if classes > num_classes:
        raise ConfigError(f"dataset: {name} has {classes} classes, the model only {num_classes}")


def to_input(images: Sequence[Any], want: InputSpec, norm: Normalise) -> torch.Tensor:
    """PIL images as one ``(N, C, H, W)`` float32 batch shaped and normalised for `want`."""
    image_mod = require("PIL.Image", "dataset.kind image_folder")
    c, h, w = want.shape
    mode = "L" if c == 1 else "RGB"
    out = torch.empty(len(images), c, h, w, dtype=torch.float32)
    for i, img in enumerate(images):
        img = img.convert(mode)
        if img.size != (w, h):
            img = img.resize((w, h), image_mod.Resampling.BILINEAR)
        pixels = np.asarray(img, dtype=np.uint8).reshape(h, w, c)
        out[i] = torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(torch.float32) / 255
    mean = norm.per_channel(c, norm.mean, "mean")
    std = norm.per_channel(c, norm.std, "std")
    return (out - mean) / std


def _class_folders(path: Path) -> list[Path]:
    if not path.is_dir():
        raise ConfigError(f"dataset.path: folder {path} does not exist")
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ConfigError(f"dataset.path: {path} has no class sub-folders")
    return folders


class ImageFolder:
    """The images under `path`, by class folder (sorted names), each folder's files sorted.

    `classes` fixes the class numbering: a held-out folder is numbered by the
    training folder's class names, so a class missing there keeps its index.
    """

    def __init__(self, path: Path, norm: Normalise, classes: Sequence[str] | None = None) -> None:
        self.name, self.norm = str(path), norm
        folders = _class_folders(path)
        names = [f.name for f in folders]
        self.classes = list(classes) if classes is not None else names
        index = {c: i for i, c in enumerate(self.classes)}
        unknown = [n for n in names if n not in index]
        if unknown:
            raise ConfigError(
                f"dataset.held_out: {path} has class folders {unknown[:3]} that the "
                "training folder has not"
            )
        self.files: list[Path] = []
        labels: list[int] = []
        for folder in folders:
            files = sorted(
                p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
            )
            self.files += files
            labels += [index[folder.name]] * len(files)
        if not self.files:
            raise ConfigError(
                f"dataset.path: {path} has no images ({', '.join(sorted(IMAGE_SUFFIXES))}) "
                "in its class folders"
            )
        self._labels = torch.tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.files)

    def check(self, want: InputSpec, num_classes: int) -> None:
        """Refuse a model whose input or classes this source cannot give."""
        check_image_model(want, num_classes, len(self.classes), self.name)
        self.norm.per_channel(want.shape[0], self.norm.mean, "mean")
        self.norm.per_channel(want.shape[0], self.norm.std, "std")

    def _open(self, file: Path) -> Any:
        image_mod = require("PIL.Image", "dataset.kind image_folder")
        try:
            with image_mod.open(file) as img:
                img.load()
                return img.copy()
        except (OSError, ValueError, image_mod.DecompressionBombError) as exc:
            raise ConfigError(f"dataset: cannot decode image {file}: {exc}") from exc

    def read(self, rows: list[int], want: InputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of `rows` shaped for `want`, and their labels; no other row is read."""
        images = [self._open(self.files[r]) for r in rows]
        return to_input(images, want, self.norm), self.read_labels(rows)

    def read_labels(self, rows: list[int]) -> torch.Tensor:
        """The int64 labels of `rows`."""
        return self._labels[torch.tensor(rows, dtype=torch.int64)]
