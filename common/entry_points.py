"""How each service is started: its installed command, found beside this Python.

The local stack and the testbed start services by these commands rather
than `python -m services...`: a module run that way is looked up in the
current folder first, so any folder named `common` or `services` there would
replace the installed package. An installed command's script imports the
package from the environment only. The names match `[project.scripts]`.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from common.errors import ConfigError

__all__ = ["SERVICE_SCRIPTS", "service_command"]

SERVICE_SCRIPTS: dict[str, str] = {
    "coordinator": "asteroid-coordinator",
    "dashboard": "asteroid-dashboard",
    "federation": "asteroid-federation",
    "gateway": "asteroid-gateway",
    "planner": "asteroid-planner",
    "profiler": "asteroid-profiler",
    "worker": "asteroid-worker",
}
"""Service name -> the console script that runs it."""


def _script_dirs() -> list[Path]:
    """Where installers put this environment's scripts: beside the interpreter, or the scheme's."""
    dirs = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    return list(dict.fromkeys(dirs))


def service_command(service: str) -> list[str]:
    """The argv prefix that starts `service` with this very interpreter.

    The script is run by `sys.executable` rather than by its `#!` line, so a
    child always gets the launcher's interpreter and environment.

    Raises:
        ConfigError: Unknown service, or its script is not installed here.

    """
    if service not in SERVICE_SCRIPTS:
        raise ConfigError(f"no service {service!r}; one of {', '.join(SERVICE_SCRIPTS)}")
    name = SERVICE_SCRIPTS[service]
    for folder in _script_dirs():
        script = folder / name
        if script.is_file():
            return [sys.executable, str(script)]
    looked = ", ".join(str(d) for d in _script_dirs())
    raise ConfigError(
        f"{name} is not installed in this environment (looked in {looked}); install the "
        "asteroid-edge package into it (pip install asteroid-edge, or make install)"
    )
