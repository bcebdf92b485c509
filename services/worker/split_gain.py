"""`python -m services.worker.split_gain`: Duan & Wu's split gain measured inside a device.

    python -m services.worker.split_gain --model JSON --layers LO HI --micro N [--repeats R]

measures layers [LO, HI) of a zoo model on a micro-batch of N random samples
with this process's cores (inside a testbed device: the device's cpuset and
quota) and prints the measurement as one JSON object. The measurement itself
is `services.lib.split_gain`'s (the profiler records it in profiles too).
"""

from __future__ import annotations

import argparse
import json

from services.lib.split_gain import layer_range, measure_split_gain

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Measure a layer range here and print the measurement as JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", required=True, help="zoo model spec as JSON")
    parser.add_argument("--layers", nargs=2, type=int, required=True, metavar=("LO", "HI"))
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--beta", type=float, default=None)
    args = parser.parse_args(argv)
    lo, hi = args.layers
    module, x = layer_range(json.loads(args.model), lo, hi, args.micro)
    got = measure_split_gain(module, x, beta=args.beta, repeats=args.repeats)
    print(json.dumps(got.as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
