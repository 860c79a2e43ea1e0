"""A guarded process's descendants end when it is killed (SIGKILL: nothing of its own runs), as a replica's vLLM
engine must when Ray is force-stopped; a pid that another process took meanwhile is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from base.waiting import wait_until
from services.orphan_guard import GRACE_S, POLL_S, end_orphans

# A process that starts its guard, then a child the way vLLM starts its engine (multiprocessing's spawn: a fresh
# interpreter) which starts one of its own, and prints their pids.
GUARDED = textwrap.dedent(
    """
    import multiprocessing, subprocess, sys, time
    from services.orphan_guard import guard_descendants

    def engine():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        time.sleep(120)

    if __name__ == "__main__":
        guard_descendants()
        multiprocessing.get_context("spawn").Process(target=engine).start()
        time.sleep(1.5)
        print("ready", flush=True)
        time.sleep(120)
    """
)


ROOT = Path(__file__).resolve().parents[2]


def test_a_killed_processs_descendants_end_within_seconds_and_so_does_its_guard(tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"  # spawn's child imports the parent's main module: a file, not `-c`
    script.write_text(GUARDED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    descendants: list[psutil.Process] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        descendants = psutil.Process(parent.pid).children(recursive=True)
        guards = [p for p in descendants if "services.orphan_guard" in " ".join(p.cmdline())]
        assert len(guards) == 1 and len(descendants) >= 3, [p.cmdline() for p in descendants]
        parent.kill()
        parent.wait(timeout=10)
        wait_until(POLL_S + GRACE_S + 5, lambda: not any(p.is_running() for p in descendants), "the orphans to end")
    finally:
        parent.kill()
        for process in descendants:
            if process.is_running():
                process.kill()


def test_a_pid_taken_by_another_process_is_left_alone() -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = psutil.Process(bystander.pid).create_time()
        assert end_orphans({bystander.pid: started - 5.0}) == []
        time.sleep(0.2)
        assert bystander.poll() is None
        assert end_orphans({bystander.pid: started}) == [bystander.pid]
        assert bystander.wait(timeout=5) is not None
    finally:
        bystander.kill()
