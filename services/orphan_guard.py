"""A watcher that ends a process's descendants once the process has ended, however it ended.

Why: `ray stop --force` and a killed raylet left both vLLM engines of a stack running (`VLLM::EngineCore`, 1.6 GB
each here; on a GPU node, the GPU's memory), re-parented to init. Ray's own reaping
(`RAY_kill_child_processes_on_worker_exit`) runs in the raylet, which those paths take away; a parent-death signal
(`PR_SET_PDEATHSIG`) must be set by the child itself, and vLLM's engine (a fresh interpreter started by
multiprocessing) and its workers set none; a thread in the replica dies with the replica.

So `guard_descendants()` starts, once per process, `python -m services.orphan_guard PID` in a session of its own (a
signal to the worker's process group does not reach it). Every `POLL_S` the guard notes the guarded process's
descendants (pid and start time; itself left out). Once the guarded process is gone (the guard has been re-parented),
it sends SIGTERM to every noted descendant still running under its noted start time and to their own children, SIGKILL
after `GRACE_S` to any left, and exits. A child started within `POLL_S` of its parent's death escapes unless it is a
noted descendant's child: vLLM starts its engine once, at the replica's start, and the engine its workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
# vLLM's engine ends within a second of SIGTERM here; past this, SIGKILL.
GRACE_S = 3.0

_guard: subprocess.Popen[bytes] | None = None


def guard_descendants() -> None:
    """Start this process's guard (once; later calls do nothing)."""
    global _guard
    if _guard is not None and _guard.poll() is None:
        return
    _guard = subprocess.Popen(
        [sys.executable, "-m", __spec__.name, str(os.getpid())],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def noted_descendants(guarded: psutil.Process) -> dict[int, float]:
    """The guarded process's descendants now, by pid, with their start times (this process left out)."""
    noted = {}
    for child in guarded.children(recursive=True):
        if child.pid == os.getpid():
            continue
        try:
            noted[child.pid] = child.create_time()
        except psutil.NoSuchProcess:
            continue
    return noted


def end_orphans(noted: dict[int, float]) -> list[int]:
    """SIGTERM every noted process still running as itself and every child it has now, SIGKILL after `GRACE_S`;
    the pids it ended."""
    alive: dict[int, psutil.Process] = {}
    for pid, started in noted.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() != started:
                continue  # the pid is another process's now
            alive[pid] = process
            alive.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    for process in alive.values():
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, left = psutil.wait_procs(list(alive.values()), timeout=GRACE_S)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=GRACE_S)
    return sorted(alive)


def watch(guarded_pid: int) -> None:
    """Note the guarded process's descendants until it is gone, then end them."""
    noted: dict[int, float] = {}
    try:
        guarded = psutil.Process(guarded_pid)
        while os.getppid() == guarded_pid:
            noted = noted_descendants(guarded)
            time.sleep(POLL_S)
    except psutil.NoSuchProcess:
        pass
    ended = end_orphans(noted)
    if ended:
        print(f"orphan guard: process {guarded_pid} ended; ended its descendants {ended}", file=sys.stderr)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
