"""What a stranger on the LAN can do: a plain DEALER sending frames built with the codec.

`Attacker.send` encodes a valid message with `common.codec.encode`, then rewrites fields
of its body, so a test can send what the pydantic models would refuse to build (a
job_id of ``*``, ``num_classes`` of 1e12) exactly as a hand-made frame would carry it.
`serving_coordinator` starts a real coordinator process that serves submissions.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

from common.codec import Limits, encode, recv_message
from common.messages import CancelJob, JobReply, Message
from common.sockets import connect_dealer
from tests.cluster import LocalCluster


def patched(body: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`body` with dotted paths (``"job.model.name"``) set to new values."""
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = body
        for part in parents:
            node = node[part]
        node[leaf] = value
    return body


class Attacker:
    """A DEALER connected to the coordinator under a name of its own choosing."""

    def __init__(self, address: str, name: str = "mallory") -> None:
        self.name = name
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = connect_dealer(self.ctx, address, name)

    def send(self, msg: Message, **changes: Any) -> None:
        """Send `msg` with the fields named by `changes` (``job__model__name``) rewritten."""
        header_frame, *tensors = encode(msg, self.name)
        header = msgpack.unpackb(header_frame, raw=False)
        patched(header["msg"], {k.replace("__", "."): v for k, v in changes.items()})
        self.sock.send_multipart([msgpack.packb(header, use_bin_type=True), *tensors])

    def reply(self, timeout_s: float) -> JobReply:
        """The next JobReply, waiting at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            _, env = recv_message(self.sock, Limits())
            if isinstance(env.msg, JobReply):
                return env.msg
        raise AssertionError(f"no JobReply within {timeout_s:g} s")

    def ask(self, msg: Message, timeout_s: float = 20, **changes: Any) -> JobReply:
        """Send and wait for the coordinator's answer."""
        self.send(msg, **changes)
        return self.reply(timeout_s)

    def close(self) -> None:
        """Release the socket."""
        self.sock.close(0)
        self.ctx.term()


def serving_coordinator(cluster: LocalCluster, timeout_s: float = 60) -> Attacker:
    """Start `asteroid-coordinator` without --job and return an attacker once it answers.

    Ready is a reply to a CancelJob of a job nobody submitted; every wait is bounded.
    """
    cluster.spawn("coordinator", ["-m", "services.coordinator.main", "--bind", cluster.addr])
    attacker = Attacker(cluster.addr)
    attacker.send(CancelJob(job_id="ready-probe"))  # queued by the DEALER until it connects
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            attacker.reply(1.0)
            return attacker
        except AssertionError:
            alive(cluster)
            if time.monotonic() > deadline:
                attacker.close()
                raise AssertionError(
                    f"coordinator did not answer within {timeout_s:g} s:\n"
                    + cluster.log("coordinator")
                ) from None


def alive(cluster: LocalCluster, name: str = "coordinator") -> None:
    """Fail, with its log, if process `name` has exited."""
    code = cluster.procs[name].poll()
    assert code is None, f"{name} exited with {code}:\n{cluster.log(name)}"
