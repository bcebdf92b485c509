"""A model as one safetensors frame: exact round trip, and what an incoming frame must pass."""

import pytest
import torch
from torch import Tensor

from common.errors import ConfigError
from common.fl.wire import state_frame, state_from_frame

SENDER = "home 3"


def reference() -> dict[str, Tensor]:
    return {
        "conv.weight": torch.randn(4, 3, 2, 2),
        "fc.bias": torch.tensor([-0.0, 1e-45, -3.4e38, 0.1], dtype=torch.float32),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "steps": torch.tensor([7, -2], dtype=torch.int64),
    }


def bits(t: Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).flatten().tolist())


def test_round_trip_is_bitwise_exact() -> None:
    ref = reference()
    ref["conv.weight"] = ref["conv.weight"].transpose(0, 1)  # not contiguous on the way in
    frame = state_frame(ref)
    assert frame.dtype == torch.uint8 and frame.dim() == 1
    back = state_from_frame([frame], ref, SENDER)
    assert back.keys() == ref.keys()
    for name, want in ref.items():
        got = back[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert bits(got) == bits(want), name
    assert torch.signbit(back["fc.bias"][0])  # -0.0 kept as -0.0


def frame_of(state: dict[str, Tensor]) -> list[Tensor]:
    return [state_frame(state)]


def without(name: str) -> dict[str, Tensor]:
    state = reference()
    del state[name]
    return state


def replaced(name: str, value: Tensor) -> dict[str, Tensor]:
    return {**reference(), name: value}


BAD = {
    "no frame": ([], "expected one uint8 frame"),
    "two frames": (
        [state_frame(reference()), state_frame(reference())],
        "expected one uint8 frame",
    ),
    "float frame": ([state_frame(reference()).float()], "expected one uint8 frame"),
    "2-d frame": ([state_frame(reference()).reshape(1, -1)], "expected one uint8 frame"),
    "garbage": ([torch.tensor(list(b"not safetensors"), dtype=torch.uint8)], "not valid"),
    "truncated": ([state_frame(reference())[:-9]], "not valid safetensors"),
    "missing": (frame_of(without("fc.bias")), r"missing \['fc.bias'\], unexpected \[\]"),
    "extra": (
        frame_of({**reference(), "evil": torch.zeros(1)}),
        r"missing \[\], unexpected \['evil'\]",
    ),
    "shape": (
        frame_of(replaced("fc.bias", torch.zeros(5))),
        r"tensor fc.bias is torch.float32 \(5,\), expected torch.float32 \(4,\)",
    ),
    "dtype": (
        frame_of(replaced("fc.bias", torch.zeros(4, dtype=torch.float64))),
        r"tensor fc.bias is torch.float64 \(4,\), expected torch.float32",
    ),
    "nan": (
        frame_of(replaced("fc.bias", torch.tensor([0.0, float("nan"), 0.0, 0.0]))),
        "tensor fc.bias holds values that are not finite",
    ),
    "inf": (
        frame_of(replaced("half", torch.full((5,), float("-inf"), dtype=torch.bfloat16))),
        "tensor half holds values that are not finite",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_frame_is_refused_naming_the_sender(case: str) -> None:
    frames, why = BAD[case]
    with pytest.raises(ConfigError, match=why) as info:
        state_from_frame(frames, reference(), SENDER)
    assert str(info.value).startswith(f"{SENDER}: ")
