"""Coverage-guided fuzzing of the wire decoder with atheris (`make fuzz`).

The fuzzer's bytes become the frames of one message: either split as they are
(raw frames), or steering a header built from a real message whose fields,
version and tensor descriptors take values the bytes choose (so that most
inputs get past msgpack into validation and tensor receiving). They go through
real inproc ZeroMQ sockets into `common.codec.recv_message`, with the same
property as the suite's hypothesis tests: a bounded message or a ProtocolError,
and the next message still decodes. Needs the "fuzz" extra
(`pip install -e '.[fuzz]'`); libFuzzer flags pass through, e.g.
`python -m tests.security.fuzz_codec_atheris -max_total_time=600`.
"""

from __future__ import annotations

import sys
from typing import Any

import atheris
import msgpack

with atheris.instrument_imports(include=["common"]):
    from common.codec import DTYPES
    from common.messages import PROTOCOL_VERSION
    from tests.security.test_fuzz_codec import TEMPLATES, Wire, check

WIRE = Wire()
BODIES = [t.model_dump(mode="json") for t in TEMPLATES]
DTYPE_NAMES = [*DTYPES, "float128"]


def value(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    """A msgpack-able value of the bytes' choosing, nested at most three deep."""
    kind = fdp.ConsumeIntInRange(0, 7 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(2**63), 2**64 - 1)
    if kind == 3:
        return fdp.ConsumeFloat()
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 16))
    if kind == 5:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))
    if kind == 6:
        return [value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    keys = [fdp.ConsumeUnicodeNoSurrogates(6) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {k: value(fdp, depth + 1) for k in keys}


def structured(fdp: atheris.FuzzedDataProvider) -> list[bytes]:
    """A real message's header with fields and tensor descriptors the bytes choose."""
    body = dict(fdp.PickValueInList(BODIES))
    for _ in range(fdp.ConsumeIntInRange(0, 2)):
        body[fdp.PickValueInList([*body, "extra"])] = value(fdp)
    metas = []
    frames = []
    for _ in range(fdp.ConsumeIntInRange(0, 5)):
        shape = [fdp.ConsumeIntInRange(0, 9) for _ in range(fdp.ConsumeIntInRange(0, 9))]
        nbytes = fdp.ConsumeIntInRange(0, 1 << 20)
        metas.append([fdp.PickValueInList(DTYPE_NAMES), shape, nbytes])
        frames.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096)))
    header = {"v": PROTOCOL_VERSION, "sender": "f", "id": 1, "t": 0.0, "msg": body}
    header["tensors"] = value(fdp) if fdp.ConsumeIntInRange(0, 9) == 0 else metas
    if fdp.ConsumeIntInRange(0, 9) == 0:
        header[fdp.PickValueInList(sorted(header))] = value(fdp)
    return [msgpack.packb(header, use_bin_type=True), *frames]


def frames_of(data: bytes) -> list[bytes]:
    """Raw frames (a count, then each frame's length and bytes) or a structured message."""
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeBool():
        return structured(fdp)
    frames = []
    for _ in range(1 + fdp.ConsumeIntInRange(0, 5)):
        frames.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096)))
    frames[-1] += fdp.ConsumeBytes(fdp.remaining_bytes())
    return frames


def one_input(data: bytes) -> None:
    """The fuzz target: any exception other than ProtocolError is a finding."""
    check(WIRE, frames_of(data))


def main() -> None:
    """Run libFuzzer over `one_input` with the command line's flags."""
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
