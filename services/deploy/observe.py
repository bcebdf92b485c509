"""What a device reports about itself, parsed from one probe over ssh.

The probe is a short shell script (`probe_script`) whose output has one
section per fact: our images, our containers with their labels, the files of
the device's folder with their SHA-256, and the images a deploy shipped
there. The device is not trusted: output is bounded, every line must match
its section's pattern, and anything else is an error naming the device.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from common.errors import AsteroidError
from services.deploy.desired import LABEL, SHIPPED

__all__ = [
    "MAX_REPORT_BYTES",
    "DeviceReport",
    "ObservedContainer",
    "ProbeError",
    "parse_report",
    "probe_script",
]

MAX_REPORT_BYTES = 4 << 20
"""Largest probe output accepted from a device."""
_MAX_LINES = 20_000

_IMAGE = re.compile(r"^(sha256:[0-9a-f]{64}) (\S{1,255})$")
_CONTAINER = re.compile(
    r"^([0-9a-f]{64})\t([A-Za-z0-9][A-Za-z0-9_.-]{0,127})\t([a-z]{1,16})\t([^\t]{0,200})"
    r"\t([a-z]{0,16})\t([0-9a-f]{0,64})\t([^\t\s]{0,64})$"
)
_FILE = re.compile(r"^([0-9a-f]{64})  \./([A-Za-z0-9._/-]{1,255})$")
_SHIPPED = re.compile(r"^(sha256:[0-9a-f]{64}) (\S{1,255})$")
_VOLUME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,127})$")
_SECTIONS = ("images", "containers", "volumes", "files", "shipped")


class ProbeError(AsteroidError):
    """A device's report could not be read (ssh failed, or its output is malformed)."""


@dataclass(frozen=True)
class ObservedContainer:
    """One of our containers as the device's engine lists it."""

    id: str
    name: str
    state: str
    status: str
    service: str
    config: str
    version: str

    @property
    def health(self) -> str:
        """healthy, unhealthy, starting, or "-" without a healthcheck (from docker's status)."""
        m = re.search(r"\((healthy|unhealthy|health: starting)\)", self.status)
        return "-" if m is None else m.group(1).removeprefix("health: ")


@dataclass(frozen=True)
class DeviceReport:
    """Everything a deploy needs to know about a device's present state."""

    images: dict[str, str] = field(default_factory=dict)
    """Reference -> image id, of our images."""
    containers: dict[str, ObservedContainer] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """Path in the device's folder -> SHA-256."""
    shipped: dict[str, str] = field(default_factory=dict)
    """Reference -> image id, of images a deploy copied to the device."""
    volumes: set[str] = field(default_factory=set)
    """Our named volumes (Redis's data)."""

    def image_ids(self) -> set[str]:
        """Ids of every image of ours the device has."""
        return set(self.images.values())


def probe_script(cluster: str, device: str, directory: str, repositories: list[str]) -> str:
    """The shell script that prints a device's report."""
    q = shlex.quote
    refs = " ".join(f"--filter reference={q(r + ':*')}" for r in repositories)
    fmt = "\t".join(
        [
            "{{.ID}}",
            "{{.Names}}",
            "{{.State}}",
            "{{.Status}}",
            f'{{{{.Label "{LABEL}.service"}}}}',
            f'{{{{.Label "{LABEL}.config"}}}}',
            f'{{{{.Label "{LABEL}.version"}}}}',
        ]
    )
    return "\n".join(
        [
            "set -e",
            "echo @@images",
            f"docker images --no-trunc {refs} --format {q('{{.ID}} {{.Repository}}:{{.Tag}}')}",
            "echo @@containers",
            f"docker ps -a --no-trunc --filter label={q(f'{LABEL}.cluster={cluster}')} "
            f"--filter label={q(f'{LABEL}.device={device}')} --format {q(fmt)}",
            "echo @@volumes",
            f"docker volume ls -q | grep -E {q(f'^asteroid-{cluster}-{device}-')} || true",
            "echo @@files",
            f"if [ -d {q(directory)} ]; then cd {q(directory)} && "
            f"find . -path ./{SHIPPED} -prune -o -type f -print0 | xargs -0r sha256sum; fi",
            "echo @@shipped",
            f"cat {q(directory + '/' + SHIPPED)} 2>/dev/null || true",
            "echo @@end",
        ]
    )


def parse_report(device: str, text: str) -> DeviceReport:
    """The report in a probe's output; ProbeError naming the device for anything unexpected."""
    if len(text) > MAX_REPORT_BYTES:
        raise ProbeError(f"device {device}: probe output is over {MAX_REPORT_BYTES} bytes")
    lines = text.splitlines()
    if len(lines) > _MAX_LINES:
        raise ProbeError(f"device {device}: probe output has over {_MAX_LINES} lines")
    if "@@end" not in lines:
        raise ProbeError(f"device {device}: probe output ended early: {text[-200:]!r}")
    report = DeviceReport()
    section = ""
    for line in lines[: lines.index("@@end")]:
        if line.startswith("@@"):
            section = line[2:]
            if section not in _SECTIONS:
                raise ProbeError(f"device {device}: unknown probe section {section!r}")
            continue
        if not line.strip():
            continue
        if section == "images" and (m := _IMAGE.match(line)):
            if not m.group(2).endswith(":<none>"):
                report.images[m.group(2)] = m.group(1)
        elif section == "containers" and (m := _CONTAINER.match(line)):
            c = ObservedContainer(*m.groups())
            report.containers[c.name] = c
        elif section == "volumes" and (m := _VOLUME.match(line)):
            report.volumes.add(m.group(1))
        elif section == "files" and (m := _FILE.match(line)):
            if ".." not in m.group(2).split("/"):
                report.files[m.group(2)] = m.group(1)
        elif section == "shipped" and (m := _SHIPPED.match(line)):
            report.shipped[m.group(2)] = m.group(1)
        else:
            raise ProbeError(
                f"device {device}: unexpected {section or 'probe'} line {line[:120]!r}"
            )
    return report
