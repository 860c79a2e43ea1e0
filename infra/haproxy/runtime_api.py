"""Client of HAProxy's runtime API (the admin-level `stats socket`): one command per connection. The syncer, the key
watcher and the ingress controller drive HAProxy through it, never by a reload (infra/haproxy/README.md).
"""

from __future__ import annotations

import csv
import io
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

ServerState = Literal["ready", "drain", "maint"]


class RuntimeAPIError(RuntimeError):
    """HAProxy refused a runtime API command (its reply is in the message)."""

    def __init__(self, command: str, reply: str) -> None:
        super().__init__(f"HAProxy runtime API refused {command!r}: {reply.strip() or '(no reply)'}")
        self.command = command
        self.reply = reply


@dataclass(frozen=True)
class ServerStat:
    """One server line of `show stat`."""

    backend: str
    server: str
    status: str  # UP, DOWN, MAINT, DRAIN, "UP 1/2", "DOWN 1/2", "no check", ...
    scur: int  # current sessions
    addr: str  # "ip:port"
    down_transitions: int = 0  # UP -> DOWN transitions since the server was added (`chkdown`)

    @property
    def admin_maint(self) -> bool:
        return self.status.startswith("MAINT")

    @property
    def draining(self) -> bool:
        return self.status.startswith("DRAIN")

    @property
    def up(self) -> bool:
        return self.status.startswith("UP") or self.status == "no check"

    @property
    def confirmed_up(self) -> bool:
        """UP by its health checks, and not on the way down ("UP 1/2")."""
        return self.status == "UP"


class RuntimeAPI:
    """Sends commands to HAProxy's runtime API over its unix socket."""

    def __init__(self, socket_path: Path | str, timeout_s: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s

    def command(self, command: str) -> str:
        """Send one command and return HAProxy's whole reply (the socket closes after it)."""
        if "\n" in command or ";" in command:
            raise ValueError(f"one command at a time, without newline or ';': {command!r}")
        return self._send(command.encode() + b"\n")

    def _send(self, data: bytes) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout_s)
            sock.connect(str(self.socket_path))
            sock.sendall(data)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def replace_ssl_cert(self, pem_path: Path | str, pem: str) -> None:
        """Swap the certificate HAProxy loaded from `pem_path` for `pem` (certificate and key): new handshakes use
        it, open connections keep theirs. A transaction (`set ssl cert`, then `commit ssl cert`)."""
        _check_token(str(pem_path))
        body = pem.strip()
        if not body or "\n\n" in body:
            raise ValueError("a PEM payload has no empty line")
        command = f"set ssl cert {pem_path}"
        reply = self._send(f"{command} <<\n{body}\n\n".encode())
        if "Transaction created" not in reply and "Transaction updated" not in reply:
            raise RuntimeAPIError(command, reply)
        command = f"commit ssl cert {pem_path}"
        reply = self.command(command)
        if "Success" not in reply:
            raise RuntimeAPIError(command, reply)

    def checked(self, command: str) -> None:
        """Run a command whose success reply is empty; any text back is HAProxy's error message."""
        reply = self.command(command)
        if reply.strip():
            raise RuntimeAPIError(command, reply)

    # Frontends.
    def pause_frontend(self, frontend: str) -> None:
        """Stop accepting connections on the frontend's listeners (a soft stop's pause: on Linux another process
        bound to the same port with SO_REUSEPORT takes them meanwhile)."""
        _check_token(frontend)
        self.checked(f"disable frontend {frontend}")

    def resume_frontend(self, frontend: str) -> None:
        _check_token(frontend)
        self.checked(f"enable frontend {frontend}")

    # Servers.
    def set_server_addr(self, backend: str, server: str, host: str, port: int) -> None:
        command = f"set server {backend}/{server} addr {host} port {int(port)}"
        reply = self.command(command)
        # Success: "IP changed from ... port changed from ..." or "no need to change the addr...".
        if "changed" not in reply and "no need to change" not in reply:
            raise RuntimeAPIError(command, reply)

    def set_server_check_port(self, backend: str, server: str, port: int) -> None:
        command = f"set server {backend}/{server} check-port {int(port)}"
        reply = self.command(command)
        if "changed" not in reply and "no need to change" not in reply:
            raise RuntimeAPIError(command, reply)

    def set_server_state(self, backend: str, server: str, state: ServerState) -> None:
        states = get_args(ServerState)
        if state not in states:
            raise ValueError(f"server state must be one of {', '.join(states)}, not {state!r}")
        self.checked(f"set server {backend}/{server} state {state}")

    def add_server(self, backend: str, server: str, host: str, port: int, options: list[str]) -> None:
        """Add a server at run time (it starts in maintenance with its health checks off)."""
        _check_token(server)
        for option in options:
            _check_token(option)
        command = f"add server {backend}/{server} {host}:{int(port)} {' '.join(options)}".rstrip()
        reply = self.command(command)
        if "New server registered" not in reply:
            raise RuntimeAPIError(command, reply)

    def enable_health(self, backend: str, server: str) -> None:
        self.checked(f"enable health {backend}/{server}")

    def set_server_health_down(self, backend: str, server: str) -> None:
        """Consider the server DOWN until its health checks pass (`rise` of them), instead of assuming it UP."""
        self.checked(f"set server {backend}/{server} health down")

    def shutdown_sessions(self, backend: str, server: str) -> None:
        """Cut every stream still attached to the server."""
        self.checked(f"shutdown sessions server {backend}/{server}")

    def del_server(self, backend: str, server: str) -> None:
        """Delete a server in maintenance; HAProxy refuses while connections are still attached to it."""
        command = f"del server {backend}/{server}"
        reply = self.command(command)
        if "Server deleted" not in reply:
            raise RuntimeAPIError(command, reply)

    # Pattern files.
    def replace_acl(self, acl_file: Path | str, patterns: Iterable[str]) -> None:
        """Replace every pattern of an ACL's file at once: a new version is filled, then committed atomically, so
        no request sees a half-written list."""
        _check_token(str(acl_file))
        command = f"prepare acl {acl_file}"
        reply = self.command(command)
        match = re.search(r"New version created: (\d+)", reply)
        if match is None:
            raise RuntimeAPIError(command, reply)
        version = match.group(1)
        for pattern in patterns:
            _check_token(pattern)
            self.checked(f"add acl @{version} {acl_file} {pattern}")
        self.checked(f"commit acl @{version} {acl_file}")

    def set_map(self, map_file: Path | str, key: str, value: str) -> None:
        """Set one key of a map (it must exist in the file HAProxy loaded)."""
        for token in (str(map_file), key, value):
            _check_token(token)
        self.checked(f"set map {map_file} {key} {value}")

    def show_map(self, map_file: Path | str) -> dict[str, str]:
        """A map's keys and values as HAProxy holds them now."""
        _check_token(str(map_file))
        reply = self.command(f"show map {map_file}")
        if reply.startswith("Unknown"):
            raise RuntimeAPIError(f"show map {map_file}", reply)
        return dict(line.split(" ", 2)[1:] for line in reply.splitlines() if line.count(" ") >= 2)

    def show_acl(self, acl_file: Path | str) -> list[str]:
        """The patterns an ACL's file holds now."""
        _check_token(str(acl_file))
        reply = self.command(f"show acl {acl_file}")
        if reply.startswith("Unknown"):
            raise RuntimeAPIError(f"show acl {acl_file}", reply)
        return [line.split(" ", 1)[1] for line in reply.splitlines() if " " in line]

    def set_table_counter(self, table: str, key: str, counter: str, value: int) -> None:
        """Set one stored counter of a stick table's entry (the entry is created when missing)."""
        for token in (table, key, counter):
            _check_token(token)
        self.checked(f"set table {table} key {key} data.{counter} {int(value)}")

    # Stats.
    def show_stat(self) -> dict[tuple[str, str], ServerStat]:
        """(backend, server) -> stats of every server (not frontends/backends), from the CSV of `show stat`."""
        reply = self.command("show stat")
        if not reply.startswith("# "):
            raise RuntimeAPIError("show stat", reply)
        rows = csv.DictReader(io.StringIO(reply[2:]))
        stats = {}
        for row in rows:
            name = row.get("svname", "")
            if name in ("FRONTEND", "BACKEND") or not name:
                continue
            stats[(row["pxname"], name)] = ServerStat(
                backend=row["pxname"],
                server=name,
                status=row.get("status", ""),
                scur=int(row.get("scur") or 0),
                addr=row.get("addr", ""),
                down_transitions=int(row.get("chkdown") or 0),
            )
        return stats

    def show_table(self, table: str) -> dict[str, dict[str, int]]:
        """A stick table's entries: key -> its stored counters by name (`http_req_rate(60000)` as `http_req_rate`)."""
        _check_token(table)
        reply = self.command(f"show table {table}")
        if not reply.startswith("# table:"):
            raise RuntimeAPIError(f"show table {table}", reply)
        entries = {}
        for line in reply.splitlines()[1:]:
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            key = fields.pop("key", None)
            if key is not None:
                entries[key] = {name.split("(")[0]: int(value) for name, value in fields.items() if value.isdigit()}
        return entries

    def backend_queues(self) -> dict[str, int]:
        """Backend -> requests queued in it (waiting for a server with a free connection), from `show stat`."""
        reply = self.command("show stat")
        if not reply.startswith("# "):
            raise RuntimeAPIError("show stat", reply)
        rows = csv.DictReader(io.StringIO(reply[2:]))
        return {row["pxname"]: int(row.get("qcur") or 0) for row in rows if row.get("svname") == "BACKEND"}

    def show_info(self) -> dict[str, str]:
        """`show info` as a dict (Pid, Uptime_sec, Process_num, Version, ...)."""
        reply = self.command("show info")
        info = {}
        for line in reply.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        if "Pid" not in info:
            raise RuntimeAPIError("show info", reply)
        return info


def _check_token(value: str) -> None:
    if not value or any(c.isspace() for c in value) or ";" in value or "\\" in value:
        raise ValueError(f"runtime API arguments must be non-empty without spaces, ';' or '\\': {value!r}")
