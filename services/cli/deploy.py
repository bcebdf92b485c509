"""`asteroid deploy up|status|down|env`: the cluster's containers on devices over ssh.

`up` ships images, keys and settings and (re)starts containers, touching only
what changed, so running it again reports "0 changes"; `status` shows each
device's services; `down` removes our containers, files and shipped images;
`env` prints the settings this machine's `asteroid` commands use the deployed
cluster with. Exit codes: CONFIG for a bad inventory, key set or missing
image; DEVICE_FAILED when a device is unreachable or a step on it fails.
The deploy engine (ssh, tar, the inventory's YAML) is imported by the commands
that use it: every `asteroid` start imports this module to register them.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from common.errors import AsteroidError, ConfigError
from common.exit_codes import ExitCode
from common.version import VERSION
from services.cli.console import CliConsole
from services.cli.failure import fail

if TYPE_CHECKING:
    from services.deploy.apply import Deployment

__all__ = ["app"]

app = typer.Typer(
    help="Deploy the cluster to devices over ssh (docker on each).", no_args_is_help=True
)
console = CliConsole(highlight=False, soft_wrap=True)

_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
DEFAULT_TAG = VERSION.replace("+", "-")
"""The tag `make images` gives this release's images (a tag cannot hold "+")."""
ACL_TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "redis-acl.conf"

InventoryOpt = Annotated[
    Path, typer.Option("--inventory", help="Devices file (see deploy/devices.example.yaml).")
]
KeysOpt = Annotated[
    Path, typer.Option("--keys", help="The cluster's key set (`asteroid keys init DIR ...`).")
]
TagOpt = Annotated[str, typer.Option("--tag", help="Image tag to deploy (default: this release).")]
AclOpt = Annotated[
    Path, typer.Option("--redis-acl", help="Redis ACL template (deploy/redis-acl.conf).")
]


def _deployment(inventory: Path, keys: Path, tag: str, redis_acl: Path) -> Deployment:
    from services.deploy.apply import Deployment
    from services.deploy.inventory import load_inventory

    if not _TAG.fullmatch(tag):
        raise ConfigError(f"image tag {tag!r} must be 1-128 letters, digits, '_', '.', '-'")
    try:
        template = redis_acl.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the Redis ACL template {redis_acl}: {exc.strerror} (give --redis-acl "
            "the deploy/redis-acl.conf of the source tree)"
        ) from exc
    inv = load_inventory(inventory)
    return Deployment(inv, keys, tag, template, echo=lambda line: console.print(line, markup=False))


def _fail(exc: AsteroidError) -> typer.Exit:
    """One line on stderr; CONFIG for bad input, else DEVICE_FAILED (a device's step)."""
    return fail(exc, ExitCode.CONFIG if isinstance(exc, ConfigError) else ExitCode.DEVICE_FAILED)


@app.command()
def up(
    inventory: InventoryOpt,
    keys: KeysOpt,
    tag: TagOpt = DEFAULT_TAG,
    redis_acl: AclOpt = ACL_TEMPLATE,
) -> None:
    """Ship images, keys and settings; (re)start what changed; report the changes."""
    started = time.monotonic()
    try:
        done = _deployment(inventory, keys, tag, redis_acl).up()
    except AsteroidError as exc:
        raise _fail(exc) from exc
    console.print(f"{len(done)} changes in {time.monotonic() - started:.1f} s")


@app.command()
def status(
    inventory: InventoryOpt,
    keys: KeysOpt,
    tag: TagOpt = DEFAULT_TAG,
    redis_acl: AclOpt = ACL_TEMPLATE,
) -> None:
    """Each device's services: running or not, health, image version, current config."""
    from services.deploy.inventory import load_inventory

    try:
        rows = _deployment(inventory, keys, tag, redis_acl).status()
    except AsteroidError as exc:
        raise _fail(exc) from exc
    table = Table(title=f"cluster {load_inventory(inventory).cluster}")
    for col in ("device", "service", "state", "health", "version", "config"):
        table.add_column(col)
    for r in rows:
        config = "current" if r.current else ("-" if r.state == "missing" else "outdated")
        table.add_row(r.device, r.service, r.state, r.health, r.version, config)
    console.print(table)
    if any(r.state != "running" for r in rows):
        raise typer.Exit(int(ExitCode.DEVICE_FAILED))


@app.command()
def down(
    inventory: InventoryOpt,
    keys: KeysOpt,
    tag: TagOpt = DEFAULT_TAG,
    redis_acl: AclOpt = ACL_TEMPLATE,
) -> None:
    """Remove our containers, their files and the images a deploy shipped."""
    try:
        done = _deployment(inventory, keys, tag, redis_acl).down()
    except AsteroidError as exc:
        raise _fail(exc) from exc
    console.print(f"{len(done)} changes")


@app.command()
def env(inventory: InventoryOpt, keys: KeysOpt) -> None:
    """Print `export` lines with which this machine's CLI trains on the deployed cluster.

    They hold the operator's Redis password: eval them, do not paste them anywhere.
    """
    from services.deploy.apply import operator_env, read_key_set
    from services.deploy.inventory import load_inventory

    try:
        settings = operator_env(load_inventory(inventory), read_key_set(keys), keys)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    for key, value in settings.items():
        typer.echo(f"export {key}={shlex.quote(value)}")
