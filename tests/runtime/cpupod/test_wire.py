"""The setup messages every CPU-pod server and its GPU stage exchange (cpupod/wire.py): whole messages, in order,
a region's descriptor with its message, and a closed peer named as such."""
import os
import socket
import threading

import pytest
from vllm_hybrid.cpupod.wire import recv_msg, send_msg


def test_messages_arrive_whole_and_in_order_with_their_descriptors(tmp_path):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    region = tmp_path / "region"
    region.write_bytes(b"weights")
    big = {"products": [[i * 4096, 4096, 14336] for i in range(20000)]}  # larger than a socket buffer
    fd = os.open(region, os.O_RDONLY)
    sender = threading.Thread(target=lambda: (send_msg(a, {"weights_bytes": 7}, [fd]), send_msg(a, big)))
    sender.start()
    first = recv_msg(b, max_fds=1)
    second = recv_msg(b)
    sender.join()
    os.close(fd)
    assert first["weights_bytes"] == 7 and len(first["fds"]) == 1
    with os.fdopen(first["fds"][0], "rb") as f:  # the same file, through the received descriptor
        assert f.read() == b"weights"
    assert second == big
    a.close()
    with pytest.raises(ConnectionError, match="connection closed"):
        recv_msg(b)
    with pytest.raises(ConnectionError, match="connection closed"):
        recv_msg(b, max_fds=1)
    b.close()
