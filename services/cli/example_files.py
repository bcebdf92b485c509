"""The example job specs, plan and cluster file shipped in the package, and `asteroid examples`.

They are package data read through `importlib.resources`, so `asteroid demo`
finds its job wherever the package is installed and whatever the current
folder holds; `asteroid examples DIR` writes them out to edit or to give to
`asteroid-coordinator --job ... --plan ...` (and `cluster.yaml` to `asteroid plan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib.resources import as_file, files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated

import typer

from common.exit_codes import ExitCode

__all__ = ["DEMO_JOB", "example_names", "example_path", "examples"]

DEMO_JOB = "job-demo.yaml"
"""The quick start's job, one of the examples."""

_FOLDER = "examples"
_SUFFIXES = (".yaml", ".json")


def _folder() -> Traversable:
    return files("services.cli") / _FOLDER


def example_names() -> list[str]:
    """File names of every shipped example, sorted."""
    return sorted(f.name for f in _folder().iterdir() if f.name.endswith(_SUFFIXES))


@contextlib.contextmanager
def example_path(name: str) -> Iterator[Path]:
    """A real file holding example `name`, for code that opens paths (valid inside the block).

    Raises:
        FileNotFoundError: No example of that name is shipped.

    """
    resource = _folder() / name
    if not resource.is_file():
        raise FileNotFoundError(f"no example {name!r}; shipped: {', '.join(example_names())}")
    with as_file(resource) as path:
        yield path


def examples(
    directory: Annotated[
        Path, typer.Argument(help="Folder to write them to (made if missing).")
    ] = Path("."),
    force: Annotated[bool, typer.Option(help="Overwrite files of the same name.")] = False,
) -> None:
    """Write the example job specs and plan into a folder, to edit and run."""
    names = example_names()
    clashes = [n for n in names if (directory / n).exists()]
    if clashes and not force:
        typer.echo(
            f"error: {directory} already has {', '.join(clashes)} (--force overwrites)", err=True
        )
        raise typer.Exit(int(ExitCode.CONFIG))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name in names:
            (directory / name).write_bytes((_folder() / name).read_bytes())
    except OSError as exc:
        typer.echo(f"error: cannot write the examples to {directory}: {exc}", err=True)
        raise typer.Exit(int(ExitCode.CONFIG)) from exc
    for name in names:
        typer.echo(f"wrote {directory / name}")
