"""Free loopback ports for the servers a test starts.

A port is picked some time before its server binds it (a fixture starts a process first, a stand-in binds on its
loop), so no other picker may hand it out meanwhile: pytest-xdist's workers (`make test-fast` runs one per core)
each pick from a slice of the range of their own, and one process never hands out a port twice.
"""

from __future__ import annotations

import os
import random
import socket

# Ray's workers take ports 10002-19999, Serve's replicas 30000-31000 and the kernel hands out
# ephemeral ports from 32768: a port the tests pick here is one none of them will grab meanwhile.
_TEST_PORTS = range(20000, 30000)
_handed_out: set[int] = set()


def _own_ports() -> range:
    """This process's slice of the test ports: worker `gwN` of `PYTEST_XDIST_WORKER_COUNT` gets the N-th share."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return _TEST_PORTS
    share = len(_TEST_PORTS) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    start = _TEST_PORTS.start + int(worker.removeprefix("gw")) * share
    return range(start, start + share)


def free_port() -> int:
    ports = _own_ports()
    if len(_handed_out) > len(ports) // 2:
        _handed_out.clear()  # the oldest were bound (or given up) long ago
    for port in random.sample(ports, 200):
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free test port between {ports.start} and {ports.stop - 1}")
