"""Commands on a device over ssh, each with a bounded time and bounded output.

The remote command is an argv joined with shell quoting, so names and paths
from the inventory never become shell syntax. Host keys are checked strictly
(a device whose key is unknown or changed is refused, never trusted on first
use), and ssh never prompts: a deploy runs unattended.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from common.errors import AsteroidError
from services.deploy.inventory import Device, Inventory

__all__ = ["MAX_OUTPUT", "Ssh", "SshError", "ssh_argv"]

MAX_OUTPUT = 8 << 20
"""Most bytes of a remote command's output kept; more is an error."""
CONNECT_TIMEOUT_S = 10


class SshError(AsteroidError):
    """A command on a device failed, timed out, or ssh could not reach it."""


def ssh_argv(dev: Device, known_hosts: Path | None, remote: Sequence[str]) -> list[str]:
    """The local `ssh` argv that runs `remote` on `dev`."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
    argv += ["-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-o", "ServerAliveInterval=5"]
    argv += ["-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR", "-p", str(dev.ssh_port)]
    if known_hosts is not None:
        argv += ["-o", f"UserKnownHostsFile={known_hosts}"]
    if dev.ssh_identity is not None:
        argv += ["-o", "IdentitiesOnly=yes", "-i", str(dev.ssh_identity)]
    return [*argv, "-l", dev.ssh_user, "--", dev.host, shlex.join(remote)]


def _tail(data: bytes) -> str:
    text = data.decode("utf-8", "replace").strip()
    return " ".join(text[-400:].split())


@dataclass(frozen=True)
class Ssh:
    """Runs commands on one device of an inventory."""

    device: Device
    known_hosts: Path | None = None

    @classmethod
    def of(cls, inv: Inventory, device: Device) -> Ssh:
        """The runner for `device` with the inventory's known_hosts file."""
        return cls(device, inv.known_hosts)

    def argv(self, remote: Sequence[str]) -> list[str]:
        """The local argv running `remote` on the device."""
        return ssh_argv(self.device, self.known_hosts, remote)

    def run(
        self,
        remote: Sequence[str],
        timeout_s: float = 60.0,
        data: bytes | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run `remote` with `data` on its stdin; SshError on failure when `check`."""
        what = f"device {self.device.name}: `{shlex.join(remote)[:200]}`"
        try:
            out = subprocess.run(
                self.argv(remote),
                input=data if data is not None else b"",
                capture_output=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise SshError(f"{what} did not finish within {timeout_s:.0f} s") from exc
        except OSError as exc:
            raise SshError(f"{what}: cannot run ssh: {exc}") from exc
        if len(out.stdout) > MAX_OUTPUT:
            raise SshError(f"{what} printed more than {MAX_OUTPUT} bytes")
        if check and out.returncode != 0:
            raise SshError(f"{what} failed ({out.returncode}): {_tail(out.stderr)}")
        return out

    def sh(self, script: str, *args: str, timeout_s: float = 60.0) -> str:
        """Run a POSIX shell script with positional `args`; its stdout."""
        out = self.run(["sh", "-c", script, "sh", *args], timeout_s=timeout_s)
        return out.stdout.decode("utf-8", "replace")

    def pipe_from(self, source: Sequence[str], remote: Sequence[str], timeout_s: float) -> None:
        """Stream local `source`'s stdout into `remote`'s stdin (`docker save | ssh docker load`).

        Both ends are killed if the pair is not done within `timeout_s`, and a
        failure of either is an SshError with its stderr.
        """
        what = f"device {self.device.name}: `{shlex.join(source)} | {shlex.join(remote)}`"
        deadline = time.monotonic() + timeout_s
        # the source's stderr goes to a file: a chatty source cannot block on a full pipe
        with tempfile.TemporaryFile() as src_err:
            try:
                src = subprocess.Popen(list(source), stdout=subprocess.PIPE, stderr=src_err)
            except OSError as exc:
                raise SshError(f"{what}: cannot start: {exc}") from exc
            try:
                dst = subprocess.Popen(
                    self.argv(remote),
                    stdin=src.stdout,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            except OSError as exc:
                _kill(src)
                raise SshError(f"{what}: cannot run ssh: {exc}") from exc
            _close(src.stdout)  # dst holds the pipe now, so src sees EPIPE if dst dies
            try:
                _, dst_err = dst.communicate(timeout=max(1.0, deadline - time.monotonic()))
                src.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise SshError(f"{what} did not finish within {timeout_s:.0f} s") from exc
            finally:
                _kill(src)
                _kill(dst)
            src_err.seek(0)
            src_text = src_err.read(MAX_OUTPUT)
        # the device's failure first: the local side's broken pipe only follows from it
        if dst.returncode != 0:
            raise SshError(f"{what}: the device failed ({dst.returncode}): {_tail(dst_err)}")
        if src.returncode != 0:
            raise SshError(f"{what}: the local side failed ({src.returncode}): {_tail(src_text)}")


def _close(stream: IO[bytes] | None) -> None:
    if stream is not None:
        stream.close()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
