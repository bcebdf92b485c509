"""What CUDA tests share: their marks and exact GPU arithmetic.

Every test that needs a GPU is marked `cuda` and skipped where torch sees none
(`make gpu-check` runs them on a machine that has one). TensorFloat-32 is
switched off while they run: cuDNN uses it for float32 convolutions by
default on Ampere and later, and its 10-bit mantissa would swamp every bound
these tests state; deterministic cuDNN algorithms keep two runs of one shape
bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
"""`pytestmark` of a CUDA test module."""


@contextlib.contextmanager
def exact_cuda() -> Iterator[torch.device]:
    """The first CUDA device, with TF32 off and deterministic cuDNN (restored afterwards)."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield torch.device("cuda", 0)
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = saved
