"""Processes of sluice's replicas that outlived them on this node: what `sluice status` lists so an operator sees a
leak (each one's memory, and how to end it).

A vLLM engine (a process titled `VLLM::...`) or a sluice HAProxy (run on a config in a frontend's or platform's
workdir under sluice's cache folder) belongs to a running replica while the replica's worker is its parent. Once its
parent has ended, the process is re-parented to the node's init (pid 1): that is an orphan, and nothing of sluice
ends it any more. `services.orphan_guard` ends them when a replica ends; these are the ones from before it, or from
a guard that was killed itself. Only the node the command runs on is read.
"""

from __future__ import annotations

from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict

from base.runtime import cache_dir

ENGINE_TITLE_PREFIX = "VLLM::"
HAPROXY_BINARY = "haproxy"
INIT_PID = 1


class OrphanProcess(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pid: int
    kind: str  # "engine" or "haproxy"
    command: str
    # Its own resident memory and that of every process under it (an engine's workers).
    rss_bytes: int


def orphan_kind(command: list[str], cache: Path) -> str | None:
    """ "engine" or "haproxy" for a process sluice's replicas start, by its command line; None for any other."""
    if command and command[0].startswith(ENGINE_TITLE_PREFIX):
        return "engine"
    if command and Path(command[0]).name == HAPROXY_BINARY and "-f" in command[:-1]:
        config = Path(command[command.index("-f") + 1])
        if config.is_relative_to(cache):
            return "haproxy"
    return None


def orphans() -> list[OrphanProcess]:
    """The engines and HAProxies on this node whose replica's worker has ended."""
    cache = cache_dir()
    found = []
    for process in psutil.process_iter(["cmdline", "ppid"]):
        try:
            command = process.info["cmdline"] or []
            kind = orphan_kind(command, cache)
            if kind is None or process.info["ppid"] != INIT_PID:
                continue
            tree = [process, *process.children(recursive=True)]
            rss = sum(member.memory_info().rss for member in tree)
        except psutil.Error:
            continue
        found.append(OrphanProcess(pid=process.pid, kind=kind, command=" ".join(command), rss_bytes=rss))
    return found


def orphan_lines(found: list[OrphanProcess]) -> list[str]:
    """What `sluice status` prints of them: one line each, then how to end them."""
    if not found:
        return []
    lines = [f"orphaned on this node (their replica has ended; nothing of sluice ends them): {len(found)}"]
    lines += [f"  pid {o.pid} {o.kind}, {o.rss_bytes / 2**30:.1f} GiB: {o.command[:80]}" for o in found]
    lines.append(f"  end them: kill {' '.join(str(o.pid) for o in found)}")
    return lines
