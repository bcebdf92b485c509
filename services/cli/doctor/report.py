"""What `asteroid doctor` found, as values; and how they read, as a table or as JSON.

Pure: the checks produce `Check` values and this module only formats them, so
the wording, the JSON shape and the exit code are tested without a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from common.exit_codes import ExitCode
from services.cli.console import shown

__all__ = ["STATUSES", "Check", "Status", "as_json", "exit_code", "render"]

Status = Literal["ok", "note", "problem", "skipped"]
STATUSES: tuple[Status, ...] = ("ok", "note", "problem", "skipped")
"""ok: as it should be; note: worth knowing, not wrong (a missing extra); problem: this
device will not work as it is (exit code 5); skipped: could not be told (what it needs failed)."""

_MARK = {
    "ok": "[green]ok[/green]",
    "note": "[yellow]note[/yellow]",
    "problem": "[red]PROBLEM[/red]",
    "skipped": "[dim]skipped[/dim]",
}


@dataclass(frozen=True)
class Check:
    """One finding: what was looked at, how it stands, and what to run when it is wrong.

    Attributes:
        name: What was checked (``coordinator``, ``redis``, ``data port``).
        status: How it stands (see `STATUSES`).
        summary: One line a person reads.
        fix: The command (or step) that mends it; empty when nothing is to be done.
        data: The same finding for machines (`--json`): numbers in base units.

    """

    name: str
    status: Status
    summary: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def exit_code(checks: Sequence[Check]) -> ExitCode:
    """OK when nothing is a problem, else DEVICE_FAILED: what a script needs to gate on.

    Not FAILED, which the exit-code table keeps for a bug: a problem found is the
    report doing its job, "this device is not ready".
    """
    return ExitCode.DEVICE_FAILED if any(c.status == "problem" for c in checks) else ExitCode.OK


def as_json(checks: Sequence[Check]) -> dict[str, Any]:
    """The report for machines: healthy or not, the problems counted, every check in order."""
    problems = sum(c.status == "problem" for c in checks)
    return {
        "healthy": problems == 0,
        "problems": problems,
        "checks": [
            {
                "name": c.name,
                "status": c.status,
                "summary": c.summary,
                "fix": c.fix,
                "data": c.data,
            }
            for c in checks
        ],
    }


def render(checks: Sequence[Check], console: Console) -> None:
    """Print the checks as a table, then each fix (or hint) under its check, then the verdict.

    Summaries and fixes may quote a peer (a coordinator's error text, a device
    name): they pass `shown`, so none of it is read as markup or controls.
    """
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("finding")
    for c in checks:
        table.add_row(shown(c.name), _MARK[c.status], shown(c.summary))
    console.print(table)
    fixes = [c for c in checks if c.fix and c.status != "ok"]
    if fixes:
        console.print()
        for c in fixes:
            console.print(f"{_MARK[c.status]} {shown(c.name)}: {shown(c.summary)}")
            label = "hint" if c.status == "skipped" else "fix"
            console.print(f"  {label}: [bold]{shown(c.fix)}[/bold]")
    problems = sum(c.status == "problem" for c in checks)
    console.print()
    if problems:
        plural = "s" if problems > 1 else ""
        code = int(ExitCode.DEVICE_FAILED)
        console.print(f"[red]{problems} problem{plural}[/red] (exit code {code})")
    else:
        console.print("[green]healthy[/green]: this device is ready to join")
