"""Small programs run inside emulated devices by the testbed tests (standard library only).

server HOST PORT            accept one TCP connection, read to EOF, print "bits/s bytes"
send HOST PORT SECONDS      send as fast as possible for SECONDS, then close
echo HOST PORT              answer one line on each of a few connections
ask HOST PORT TIMEOUT       send a line and print the answer ("unreachable" on timeout)
burn SECONDS                spin, then print CPU seconds / wall seconds
hog MIB                     allocate and touch MIB mebibytes, then print "survived"
whoami                      print the host name and this process's cgroups
"""

from __future__ import annotations

import socket
import sys
import time


def server(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            total, start = 0, None
            while chunk := conn.recv(1 << 20):
                if start is None:
                    start = time.monotonic()
                total += len(chunk)
            elapsed = time.monotonic() - (start or time.monotonic())
    print(f"{total * 8 / max(elapsed, 1e-9):.0f} {total}", flush=True)


def send(host: str, port: int, seconds: float) -> None:
    buf = b"x" * (1 << 18)
    with socket.create_connection((host, port), timeout=30) as s:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s.sendall(buf)


def echo(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        print("listening", flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(conn.recv(1024).upper())


def ask(host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"hello")
            print(s.recv(1024).decode())
    except OSError:
        print("unreachable")


def burn(seconds: float) -> None:
    wall0, cpu0 = time.monotonic(), time.process_time()
    while time.monotonic() - wall0 < seconds:
        pass
    print(f"{(time.process_time() - cpu0) / (time.monotonic() - wall0):.3f}")


def hog(mib: int) -> None:
    block = bytearray(mib << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    print("survived")


def whoami() -> None:
    print(socket.gethostname())
    with open("/proc/self/cgroup") as f:
        print(f.read())


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "server":
        server(args[0], int(args[1]))
    elif cmd == "send":
        send(args[0], int(args[1]), float(args[2]))
    elif cmd == "echo":
        echo(args[0], int(args[1]))
    elif cmd == "ask":
        ask(args[0], int(args[1]), float(args[2]))
    elif cmd == "burn":
        burn(float(args[0]))
    elif cmd == "hog":
        hog(int(args[0]))
    elif cmd == "whoami":
        whoami()
