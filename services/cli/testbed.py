"""`asteroid testbed up|down|status`: emulated edge devices on this machine (root only).

`up` builds a preset (Asteroid's Env A-D, Galaxy's A-F) or a testbed file and
runs the services on it in the foreground until Ctrl-C, or until `--job`
ends; `down` removes whatever crashed runs left (namespaces, links, cgroups,
processes); `status` shows every testbed found. Exit codes:
`common.exit_codes.ExitCode` (CONFIG when not root). The testbed package
(and through job specs, torch) is imported inside the commands, so
`asteroid --help` does not load it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.table import Table

from common.errors import ConfigError
from services.cli.console import CliConsole, shown
from services.cli.foreground import STOP, foreground

if TYPE_CHECKING:
    from services.testbed.bed import Testbed
    from services.testbed.spec import TestbedSpec

__all__ = ["PRESET_NAMES", "app"]

PRESET_NAMES = (
    "env-a",
    "env-b",
    "env-c",
    "env-d",
    "galaxy-a",
    "galaxy-b",
    "galaxy-c",
    "galaxy-d",
    "galaxy-e",
    "galaxy-f",
)
"""The names of `services.testbed.spec.PRESETS`, for the help text (a test keeps them equal)."""

app = typer.Typer(
    help="Emulated edge devices on this machine: namespaces, shaped links, cgroups (root).",
    no_args_is_help=True,
)
console = CliConsole()
MiB = 1 << 20


def _spec(preset_name: str | None, file: Path | None, link: str, subnet: str | None) -> TestbedSpec:
    from common.errors import validation_message
    from services.testbed.spec import TestbedSpec, load_testbed, preset

    if preset_name and file:
        raise ConfigError("give --preset or --file, not both")
    spec = load_testbed(file) if file is not None else preset(preset_name or "env-a", link)
    if subnet is None:
        return spec
    try:
        return TestbedSpec.model_validate({**spec.model_dump(), "subnet": subnet})
    except ValidationError as exc:
        raise ConfigError(f"--subnet: {validation_message(exc)}") from None


def _devices_table(tb: Testbed) -> Table:
    table = Table(title=f"testbed {tb.spec.name} (tag {tb.tag})")
    for col in ("device", "kind", "address", "cpu", "memory", "link"):
        table.add_column(col)
    for d in tb.spec.devices:
        link = f"{d.bandwidth_bps / 1e6:g} Mbit/s"
        if d.latency_ms and tb.netem:
            link += f", {d.latency_ms:g} ms"
        if d.loss_pct:
            link += f", {d.loss_pct:g}% loss"
        table.add_row(
            d.name,
            d.kind,
            tb.address(d.name),
            f"{d.cpu:g}",
            f"{d.memory_bytes // MiB} MiB",
            link,
        )
    return table


Preset = Annotated[
    str | None,
    typer.Option("--preset", help=f"Environment: {', '.join(PRESET_NAMES)} (default env-a)."),
]
File = Annotated[Path | None, typer.Option("--file", help="A testbed YAML instead of a preset.")]
Link = Annotated[str, typer.Option(help="Link rate of a preset's devices: 100mbit or 1gbit.")]
Tag = Annotated[str | None, typer.Option(help="Short id in the names created (default: random).")]
Subnet = Annotated[
    str | None,
    typer.Option(help="Private subnet instead of the testbed's (two testbeds need two)."),
]


@app.command()
def up(
    preset_name: Preset = None,
    file: File = None,
    link: Link = "1gbit",
    job: Annotated[Path | None, typer.Option(help="Also train this job (YAML).")] = None,
    logs: Annotated[Path, typer.Option(help="Folder for each process's log.")] = Path(
        "testbed-logs"
    ),
    tag: Tag = None,
    subnet: Subnet = None,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads per worker.")] = 1,
) -> None:
    """Build the testbed and run the services on it until Ctrl-C (or until --job ends)."""
    from services.cli.follow import load_checked, submit_and_follow
    from services.cli.jobs import view_exit_code
    from services.testbed.bed import Testbed, require_root

    with foreground(console, "interrupted; the testbed is removed"):
        require_root()
        spec = _spec(preset_name, file, link, subnet)
        job_spec = load_checked(job, len(spec.devices)) if job else None
        console.print(f"starting {len(spec.devices)} devices and the services (logs in {logs}/)")
        with Testbed(spec, logs, tag=tag, threads=threads, stop=STOP) as tb:
            tb.up(services=True)
            console.print(_devices_table(tb))
            console.print(
                f"coordinator {tb.coordinator}, Redis {tb.redis_url}\n"
                f"submit with: ASTEROID_COORDINATOR={tb.coordinator} "
                f"ASTEROID_REDIS_URL={tb.redis_url} ASTEROID_CLUSTER={tb.cluster} "
                f"ASTEROID_KEYS={tb.keys} asteroid train JOB.yaml"
            )
            os.environ["ASTEROID_KEYS"] = str(tb.keys)  # --job is submitted as its operator
            if job_spec is not None:
                view = submit_and_follow(
                    tb.coordinator, tb.redis_url, tb.cluster, job_spec, console
                )
                console.print(
                    f"job {shown(job_spec.job_id)} {shown(view.state)} {shown(view.error)}"
                )
                raise typer.Exit(int(view_exit_code(view)))
            while not STOP.is_set():
                tb.check()
                time.sleep(0.5)
            raise KeyboardInterrupt("stop requested")


@app.command()
def down(
    tag: Annotated[
        str, typer.Option(help="Only testbeds whose tag starts with this (default: all).")
    ] = "",
) -> None:
    """Remove every testbed on this machine (crashed runs' leftovers), saying what went."""
    from services.testbed.bed import require_root
    from services.testbed.survey import cleanup_leftovers

    with foreground(console, "interrupted; the testbed is removed"):
        require_root()
        removed = cleanup_leftovers(tag)
        for line in removed:
            console.print(f"removed {line}")
        console.print("nothing to remove" if not removed else f"{len(removed)} removed")


def _short(process: str) -> str:
    """A process as pid and service name, so the table stays narrow (e.g. "1234 worker")."""
    pid, _, cmd = process.partition(" ")
    words = cmd.split()
    scripts = [Path(w).name for w in words[:2] if Path(w).name.startswith("asteroid-")]
    if scripts:  # a service's installed command, run by its interpreter
        return f"{pid} {scripts[0].removeprefix('asteroid-')}"
    if "-m" in words[:-1] and words[words.index("-m") + 1].startswith("services."):
        return f"{pid} {words[words.index('-m') + 1].split('.')[1]}"
    return f"{pid} {' '.join(Path(w).name if i == 0 else w for i, w in enumerate(words[:3]))}"


@app.command("status")
def status_cmd() -> None:
    """Show every testbed: namespaces, links with their shaping, cgroups, processes."""
    from services.testbed.bed import require_root
    from services.testbed.survey import status

    with foreground(console, "interrupted; the testbed is removed"):
        require_root()
        found = status()
        if not found:
            console.print("no testbed on this machine")
        for tag, devices in found.items():
            table = Table(title=f"testbed tag {tag}")
            for col in ("device", "namespace / address", "up / down link", "cpu", "memory"):
                table.add_column(col)
            table.add_column("state")
            table.add_column("processes")
            for d in devices:
                memory = "-" if d.memory_limit is None else f"{d.memory_limit // MiB} MiB"
                memory += f", peak {d.peak_memory // MiB} MiB"
                if d.oom_kills:
                    memory += f", [red]{d.oom_kills} OOM kills[/red]"
                table.add_row(
                    d.name,
                    f"{d.netns or '-'}\n{d.address or '-'}",
                    f"{d.uplink or '-'}\n{d.downlink or '-'}",
                    "-" if d.cpu is None else f"{d.cpu:g}",
                    memory,
                    "frozen" if d.frozen else "running",
                    "\n".join(_short(p) for p in d.processes) or "-",
                )
            console.print(table)
