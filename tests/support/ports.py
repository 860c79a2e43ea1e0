"""Free loopback ports for the servers a test starts."""

from __future__ import annotations

import random
import socket

# Ray's workers take ports 10002-19999, Serve's replicas 30000-31000 and the kernel hands out
# ephemeral ports from 32768: a port the tests pick here is one none of them will grab meanwhile.
_TEST_PORTS = range(20000, 30000)


def free_port() -> int:
    for port in random.sample(_TEST_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free test port between 20000 and 29999")
