"""How long `asteroid` takes to start: the commands that only ask, before and after.

    python -m tests.bench.bench_cli_start [--out DIR] [--runs N] [--before REV]

Each command runs `--runs` times in a fresh interpreter (after one unmeasured run
that warms the file cache), in this checkout ("after") and in a git worktree of
`--before` ("before", default e500fc9, where `cancel`, `drain` and `infer` imported
torch), with the same interpreter and packages, the two trees taking turns run by
run. The targets answer at once or not at all: a Redis port that refuses
(`status`), a coordinator port nobody listens on with the shortest reply timeout
(`cancel`: its 0.1 s wait is in both columns). One more run with ``-X importtime``
tells whether torch was imported.

Written, with `--out` (default bench-results/cli), as cli_start.md and
cli_start.csv: median, fastest and slowest wall time per command and tree, the
median CPU time (which a busy machine does not inflate), and the load average
while it ran (the wall times grow with it); exit 0 when every
command ran in both trees.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOBODY = "tcp://127.0.0.1:1"
COMMANDS: dict[str, list[str]] = {
    "--version": ["--version"],
    "status": ["status", "--redis-url", "redis://127.0.0.1:1/0"],
    "cancel": ["cancel", "job-x", "--coordinator", NOBODY, "--reply-timeout", "0.1"],
    "infer --help": ["infer", "--help"],
}
"""What is measured: `asteroid ARGS`, by the name the table gives it."""

_TIMEOUT_S = 120.0

Results = dict[str, dict[str, float | bool]]
"""Per command: median_s, min_s, max_s, and torch (whether it was imported)."""


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached git worktree of `rev`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="cli-start-") as tmp:
        tree = Path(tmp) / "tree"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)


def _env(tree: Path, state: Path) -> dict[str, str]:
    """This environment, without ASTEROID_* settings, importing from `tree` first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    env["PYTHONPATH"] = str(tree)
    env["XDG_STATE_HOME"] = str(state)
    return env


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(tree: Path, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one `asteroid ARGS` in a fresh interpreter in `tree`.

    On a busy machine the wall time waits for a core; the CPU time does not, and
    is what the start costs on an idle one (the start is one thread).
    """
    cpu = _children_cpu_s()
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    return time.perf_counter() - started, _children_cpu_s() - cpu


def imports_torch(tree: Path, args: list[str], env: dict[str, str]) -> bool:
    """Whether `asteroid ARGS` imports torch (from ``-X importtime``'s report)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.cli", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    return any(line.rpartition("|")[2].strip() == "torch" for line in proc.stderr.splitlines())


def measure(trees: dict[str, Path], runs: int) -> dict[str, Results]:
    """Median, fastest and slowest start of each command in each tree, and torch or not.

    The trees take turns, run by run, so that a change of load on a shared machine
    weighs on both columns alike.
    """
    results: dict[str, Results] = {label: {} for label in trees}
    with tempfile.TemporaryDirectory(prefix="cli-state-") as state:
        envs = {label: _env(tree, Path(state) / label) for label, tree in trees.items()}
        for name, args in COMMANDS.items():
            walls: dict[str, list[float]] = {label: [] for label in trees}
            cpus: dict[str, list[float]] = {label: [] for label in trees}
            for label, tree in trees.items():
                run_once(tree, args, envs[label])  # warms the file cache; not counted
            for _ in range(runs):
                for label, tree in trees.items():
                    wall, cpu = run_once(tree, args, envs[label])
                    walls[label].append(wall)
                    cpus[label].append(cpu)
            for label, tree in trees.items():
                r = results[label][name] = {
                    "median_s": statistics.median(walls[label]),
                    "min_s": min(walls[label]),
                    "max_s": max(walls[label]),
                    "cpu_s": statistics.median(cpus[label]),
                    "torch": imports_torch(tree, args, envs[label]),
                }
                print(f"{label:>6} {name:<14} {r['median_s']:.2f} s, CPU {r['cpu_s']:.2f} s")
    return results


def write(out: Path, rev: str, runs: int, before: Results, after: Results, load: str) -> None:
    """cli_start.csv and cli_start.md in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "cli_start.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["command", "tree", "median_s", "min_s", "max_s", "cpu_median_s", "imports_torch"]
        )
        for tree, results in (("before", before), ("after", after)):
            for name, r in results.items():
                times = [f"{float(r[key]):.3f}" for key in ("median_s", "min_s", "max_s", "cpu_s")]
                writer.writerow([name, tree, *times, r["torch"]])
    lines = [
        "# `asteroid` start time",
        "",
        f"Median of {runs} cold starts (fresh interpreter, warm file cache) per command; "
        f"before: {rev}, after: this checkout; load average while measuring: {load}. "
        "Wall: median seconds until the command ended; CPU: median CPU seconds it used "
        "(what its wall time is on an idle machine).",
        "",
        "| command | wall before | wall after | CPU before | CPU after | torch before | after |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name in COMMANDS:
        b, a = before[name], after[name]
        lines.append(
            f"| `asteroid {name}` | {b['median_s']:.2f} s | {a['median_s']:.2f} s | "
            f"{b['cpu_s']:.2f} s | {a['cpu_s']:.2f} s | "
            f"{'yes' if b['torch'] else 'no'} | {'yes' if a['torch'] else 'no'} |"
        )
    (out / "cli_start.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Measure both trees, write the table, print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "cli")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", default="e500fc9", help="git revision to compare with")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    load_start = os.getloadavg()[0]
    with worktree(args.before) as tree:
        results = measure({"before": tree, "after": ROOT}, args.runs)
    before, after = results["before"], results["after"]
    load = f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    write(args.out, args.before, args.runs, before, after, load)
    print((args.out / "cli_start.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
