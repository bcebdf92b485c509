"""Flags and `ASTEROID_*` variables into a service's settings, or one line saying what is wrong.

Every `asteroid-<service>` parses its command line here, so all of them
answer `--version` alike and refuse a bad flag alike: one line on stderr
naming the flag (and its variable), what was expected and what was given,
then exit code 2 (`ExitCode.CONFIG`), never a traceback. The `asteroid`
command uses the same wording for settings it builds from its options.
pydantic-settings and the settings themselves are imported by the functions that
use them: `asteroid` imports this module at every start, for its error lines.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar, cast

from pydantic import ValidationError

from common.exit_codes import ExitCode
from common.secrets import mask_text
from common.version import VERSION

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo
    from pydantic_core import ErrorDetails
    from pydantic_settings import BaseSettings, SettingsError

__all__ = [
    "error_line",
    "exit_with_error",
    "is_settings_error",
    "metavar",
    "parse_settings",
    "tidy_help",
]

S = TypeVar("S", bound="BaseSettings")

_MAX_SHOWN = 80
"""Longest given value quoted back; flags are hostile input too and the line stays one line."""
_METAVARS: dict[object, str] = {str: "TEXT", int: "N", float: "NUMBER", Path: "PATH"}


def parse_settings(cls: type[S], argv: Sequence[str] | None, prog: str) -> S:
    """`cls` from `argv` (default: this process's arguments) over the environment.

    `--version` prints "`prog` VERSION" and exits 0; `--help` is generated from
    the fields. A flag or variable that does not validate ends the process
    through `exit_with_error`.
    """
    from pydantic_settings import CliApp, CliSettingsSource, SettingsError

    args = list(sys.argv[1:] if argv is None else argv)
    source: CliSettingsSource[object] = CliSettingsSource(
        cls, cli_prog_name=prog, cli_exit_on_error=False
    )
    source.root_parser.add_argument(  # type: ignore[attr-defined]
        "--version",
        action="version",
        version=f"%(prog)s {VERSION}",
        help="print the version and exit",
    )
    tidy_help(cast(argparse.ArgumentParser, source.root_parser), cls)
    try:
        return CliApp.run(cls, cli_args=args, cli_settings_source=source)
    except (SettingsError, ValidationError) as exc:
        exit_with_error(prog, exc)


def metavar(field: FieldInfo) -> str | None:
    """What `--help` shows a flag takes: a word a person reads, not a Python type.

    pydantic-settings writes the type (`{Path,null}`, `tuple[str,...]`, `int` for a
    byte count that takes `2GB`); None leaves a switch or a choice as it is.
    """
    from common.units import parse_bytes, parse_bytes_per_s

    kind = field.annotation
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]  # X | None: a value or nothing
    validators = {getattr(m, "func", None) for m in field.metadata}
    if parse_bytes in validators:
        return "BYTES"
    if parse_bytes_per_s in validators:
        return "BYTES/S"
    if typing.get_origin(kind) in (tuple, list):
        return "A,B,..."
    if kind is bool or typing.get_origin(kind) is typing.Literal:
        return None
    return _METAVARS.get(kind, "VALUE")


def tidy_help(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """`parser`'s help as a person reads it: plain metavars, no `null`, no ignored flags.

    A setting the service never reads (`CLI_HIDDEN`: the coordinator's own
    `--coordinator`) is still accepted, as the same ASTEROID_* environment serves
    every service, but not offered.
    """
    hidden: frozenset[str] = getattr(cls, "CLI_HIDDEN", frozenset())
    for action in parser._actions:
        name = action.dest.replace("-", "_")
        field = cls.model_fields.get(name)
        if field is None or not action.option_strings:
            continue
        if name in hidden:
            action.help = argparse.SUPPRESS
            continue
        shown = metavar(field)
        if shown is not None and action.nargs != 0:
            action.metavar = shown
        if isinstance(action.help, str):
            action.help = action.help.replace("(default: null)", "(default: none)").replace(
                "(default: ())", "(default: none)"
            )


def exit_with_error(prog: str, exc: SettingsError | ValidationError) -> NoReturn:
    """Print `exc` as one line on stderr, prefixed by `prog`, and exit with ExitCode.CONFIG."""
    print(f"{prog}: error: {error_line(exc)}", file=sys.stderr)
    raise SystemExit(int(ExitCode.CONFIG))


def is_settings_error(exc: ValidationError) -> bool:
    """Whether `exc` came from validating settings (flags, variables), not data or messages."""
    from common.settings import CommonSettings

    return exc.title in {c.__name__ for c in _settings_classes(CommonSettings)}


def error_line(exc: SettingsError | ValidationError) -> str:
    """One line naming each bad flag, what it expects and (credentials hidden) what it got."""
    if not isinstance(exc, ValidationError):  # pydantic-settings' own (a flag it cannot parse)
        text = str(exc).removeprefix("error parsing CLI: ")
    else:
        text = "; ".join(_describe(err) for err in exc.errors(include_url=False))
    return " ".join(mask_text(text).split())


def _describe(err: ErrorDetails) -> str:
    loc = [str(part) for part in err["loc"]]
    message = err["msg"]
    ctx = err.get("ctx") or {}
    if err["type"] == "value_error" and "error" in ctx:
        message = str(ctx["error"])  # without pydantic's "Value error, " prefix
    given = err["input"]
    if isinstance(given, str | int | float) and not isinstance(given, bool):
        message += f" (got {_shown(str(given))!r})"
    if not loc:
        return message
    from common.settings import CommonSettings

    name = loc[0]
    prefix = str(CommonSettings.model_config.get("env_prefix", ""))
    where = f"--{name.replace('_', '-')} ({prefix}{name.upper()})"
    return f"{where}{''.join(f'[{p}]' for p in loc[1:])}: {message}"


def _shown(value: str) -> str:
    """`value` fit to quote back: credentials hidden, even in a URL missing its scheme."""
    value = mask_text(value)
    if "@" in value and "://" not in value:
        value = "***@" + value.rsplit("@", 1)[1]
    return value if len(value) <= _MAX_SHOWN else value[: _MAX_SHOWN - 3] + "..."


def _settings_classes(cls: type[BaseSettings]) -> list[type[BaseSettings]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _settings_classes(sub))]
