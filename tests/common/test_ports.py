"""Ports handed to services lie below the ephemeral range, are bindable and never repeat."""

from __future__ import annotations

import socket

import pytest

from common import ports
from common.ports import _ephemeral_start, free_port


def test_ports_are_free_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < max(21000, _ephemeral_start()) for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # really free


def test_a_port_someone_listens_on_is_never_returned(monkeypatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        taken = busy.getsockname()[1]
        busy.listen()
        monkeypatch.setattr(ports, "_handed_out", set())  # only the bind check keeps it out
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: taken)
        with pytest.raises(OSError, match="no free port"):
            free_port(attempts=5)
