"""The setup messages between a CPU pod's server and its GPU stage, on a Unix socket in the replica's shared
/dev/shm: a 4-byte length, then JSON; file descriptors (regions) travel with a message's first bytes (SCM_RIGHTS)."""
from __future__ import annotations

import json
import socket
import struct


def send_msg(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack("<I", len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0  # the fds travel with the first bytes
    sock.sendall(data[sent:])


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, max_fds: int = 0) -> dict:
    """A message; with max_fds, the file descriptors that came with it are under "fds"."""
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, 4, max_fds)
        if not head:
            raise ConnectionError("connection closed")
        head += recv_exact(sock, 4 - len(head))
    else:
        head = recv_exact(sock, 4)
    (n,) = struct.unpack("<I", head)
    msg = json.loads(recv_exact(sock, n))
    return {**msg, "fds": fds} if max_fds else msg
