"""Private network namespaces with loopback alone: where the bench runs Ray's own HAProxy, which binds ports on every
interface (sluice serves on loopback only)."""

from __future__ import annotations

import socket
import sys

from base.runtime import LOOPBACK

# Brings `lo` up (SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP) and execs the command: no `ip` binary needed.
_LOOPBACK_UP_EXEC = (
    "import fcntl, os, socket, struct, sys\n"
    "with socket.socket() as s:\n"
    "    flags = struct.unpack('16sh22x', fcntl.ioctl(s, 0x8913, struct.pack('16sh22x', b'lo', 0)))[1]\n"
    "    fcntl.ioctl(s, 0x8914, struct.pack('16sh22x', b'lo', flags | 1))\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def private_netns_argv(argv: list[str]) -> list[str]:
    """`argv` run in a new network namespace whose only interface, `lo`, is up (needs root)."""
    return ["unshare", "--net", sys.executable, "-c", _LOOPBACK_UP_EXEC, *argv]


def in_private_netns() -> bool:
    """Whether this process's network namespace has no interface but loopback (and it is up)."""
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        return False
    # A fresh namespace's `lo` is down, yet binding 127.0.0.1 works there: only a connection shows it is up.
    with socket.socket() as listener, socket.socket() as client:
        listener.bind((LOOPBACK, 0))
        listener.listen()
        try:
            client.connect(listener.getsockname())
        except OSError:
            return False
    return True
