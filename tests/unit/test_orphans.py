"""`sluice status` lists the engines and HAProxies on its node whose replica has ended (re-parented to init), and
leaves alone the ones a running process still holds and every other process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil

from base.runtime import cache_dir
from base.waiting import wait_until
from sluice.deploy.orphans import orphan_kind, orphan_lines, orphans

TITLE = "VLLM::EngineCore-orphan-test"


def test_engines_and_sluices_haproxy_are_told_by_their_command_line(tmp_path: Path) -> None:
    cache = cache_dir()
    assert orphan_kind(["VLLM::EngineCore"], cache) == "engine"
    ours = ["/opt/bin/haproxy", "-W", "-db", "-f", str(cache / "frontend-team-app-12" / "haproxy.cfg")]
    assert orphan_kind(ours, cache) == "haproxy"
    assert orphan_kind(["/usr/sbin/haproxy", "-f", str(tmp_path / "haproxy.cfg")], cache) is None, "not sluice's"
    assert orphan_kind(["/usr/sbin/haproxy", "-f"], cache) is None
    assert orphan_kind(["python", "-m", "vllm"], cache) is None and orphan_kind([], cache) is None


def test_an_engine_re_parented_to_init_is_listed_with_its_memory_and_one_with_a_parent_is_not() -> None:
    # `exec -a` titles the process as vLLM titles its engine; the subshell's exit re-parents it to init.
    subprocess.run(["bash", "-c", f"(exec -a {TITLE} sleep 60 &)"], check=True)
    held = subprocess.Popen(["bash", "-c", f"exec -a {TITLE}-held sleep 60"])
    try:
        wait_until(5, lambda: any(o.command.startswith(TITLE + " ") for o in orphans()), "the orphan to show")
        found = [o for o in orphans() if o.command.startswith(TITLE)]
        assert [o.command for o in found] == [f"{TITLE} 60"], "the held one has its parent"
        assert found[0].kind == "engine" and found[0].rss_bytes > 0
        lines = orphan_lines(found)
        assert f"pid {found[0].pid} engine" in lines[1] and lines[-1] == f"  end them: kill {found[0].pid}"
    finally:
        held.kill()
        for process in psutil.process_iter(["cmdline"]):
            if (process.info["cmdline"] or [""])[0] == TITLE:
                process.kill()
