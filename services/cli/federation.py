"""`asteroid federation ID`: how a federation of homes is doing, read from its Redis.

What `asteroid-federation` records (`services.federation.service`): its state and
version, and one entry per ended round; optionally the newest global model is
written to a safetensors file that plain PyTorch loads into the zoo model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from common.errors import ConfigError
from services.cli.console import shown
from services.cli.jobs import ClusterOpt, RedisOpt, console, open_store
from services.cli.metrics import fail

__all__ = ["federation", "rounds_table", "unheld_warnings"]


def unheld_warnings(entries: list[dict[str, Any]]) -> list[str]:
    """The first round's warning that Eco-FL's band cannot hold some homes (none: [])."""
    found = (e.get("unheld") for e in entries)
    return [str(u["warning"]) for u in found if isinstance(u, dict) and "warning" in u][:1]


def _regroups(entry: dict[str, Any]) -> str:
    moves = entry.get("regroups") or []
    return ", ".join(f"{h} {a}" + ("" if g is None else f" -> {g}") for h, a, g in moves)


def rounds_table(entries: list[dict[str, Any]], last: int) -> Table:
    """The last `last` ended rounds: when, which group, who, the version and its accuracy."""
    table = Table(title=f"rounds (last {min(last, len(entries))} of {len(entries)})")
    for col in ("time s", "version", "accuracy", "group", "members", "failed", "regroups"):
        table.add_column(col)
    for e in entries[-last:]:
        group = e.get("group", "")
        table.add_row(
            f"{e.get('time_s', 0.0):.1f}",
            shown(e.get("version", "")),
            f"{e.get('accuracy', -1.0):.3f}",
            "probe" if "group" in e and group is None else "first" if group == -1 else shown(group),
            shown(" ".join(map(str, e.get("members", [])))),  # homes name themselves
            shown(" ".join(map(str, e.get("failed", [])))),
            shown(_regroups(e)),
        )
    return table


def federation(
    federation_id: Annotated[str, typer.Argument(help="The federation's id (its spec's).")],
    last: Annotated[int, typer.Option(min=1, help="Rounds to list.")] = 20,
    out: Annotated[
        Path | None, typer.Option(help="Write the newest global model here (.safetensors).")
    ] = None,
    redis_url: RedisOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """A federation's state, groups and latest rounds (asteroid-federation's records)."""
    from common.job import check_job_id  # torch comes with it: not for --help

    try:
        fid = check_job_id(federation_id, "the command line")
    except ConfigError as exc:
        raise fail(exc) from exc
    store = open_store(redis_url, cluster)
    try:
        fields = store.get_fields("fl", fid)
        if not fields:
            raise fail(ConfigError(f"no federation {fid} in this Redis cluster prefix"))
        entries = store.read("fl-metrics", fid)
        console.print(
            f"federation {fid}: {fields.get('state')}, version {fields.get('version')}, "
            f"held-out accuracy {float(fields.get('accuracy', -1.0)):.3f}, "
            f"{fields.get('homes')} homes"
        )
        if entries:
            console.print(f"groups {entries[-1].get('groups')}, out {entries[-1].get('dropped')}")
            for warning in unheld_warnings(entries):
                console.print(f"[yellow]warning:[/yellow] {shown(warning)}")
            console.print(rounds_table(entries, last))
        if out is not None:
            blob = store.get_blob("fl-model", fid)
            if blob is None:
                raise fail(ConfigError(f"federation {fid} has stored no model yet"))
            out.write_bytes(blob)
            console.print(f"wrote the global model to {out}")
    finally:
        store.close()
