"""Ray 2.60's own HAProxy direct streaming (the benchmark peer) streams the tiny model and leaves nothing behind.

The peer only runs inside a private network namespace (Ray's HAProxy mode binds all interfaces), so this test needs
root and `unshare`: without them it fails, naming what is missing, instead of skipping a benchmark peer unnoticed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from base.tiny_model import SERVED_MODEL_NAME
from sluice.bench.netns import private_netns_argv
from sluice.bench.ray_peer import peer_processes

pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

# Runs inside the namespace: one peer replica, the same greedy chat through Ray's HAProxy and the replica's own port.
_CLIENT = """
import asyncio, json, sys
from pathlib import Path
from sluice.bench.netns import in_private_netns
from sluice.bench.ray_peer import running_ray_peer, stream_chat

assert in_private_netns()
with running_ray_peer(Path(sys.argv[1]), Path(sys.argv[2]), replicas=1) as peer:
    via_haproxy = asyncio.run(stream_chat(peer.url))
    via_replica = asyncio.run(stream_chat(peer.replica_urls[0]))
print(json.dumps({"haproxy": via_haproxy, "replica": via_replica, "replica_urls": peer.replica_urls}))
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Ray's unix sockets live under the peer's workdir: pytest's tmp_path is too long for them.
    path = Path(tempfile.mkdtemp(prefix="rpt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _require_private_netns() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail(f"the Ray peer needs root and unshare for its private network namespace (euid {os.geteuid()})")
    probe = "from sluice.bench.netns import in_private_netns; raise SystemExit(0 if in_private_netns() else 1)"
    trial = subprocess.run(private_netns_argv([sys.executable, "-c", probe]), capture_output=True, text=True)
    if trial.returncode != 0:
        pytest.fail(f"no private network namespace with loopback up (rc {trial.returncode}): {trial.stderr[-2000:]}")


def test_ray_haproxy_streams_the_tiny_models_greedy_completion_and_leaves_no_process(
    tiny_model_dir: Path, workdir: Path
) -> None:
    _require_private_netns()
    argv = private_netns_argv([sys.executable, "-c", _CLIENT, str(tiny_model_dir), str(workdir)])
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    peer_log = workdir / "ray-peer.log"
    log = peer_log.read_text(errors="replace")[-4000:] if peer_log.exists() else ""
    assert run.returncode == 0, f"{run.stderr[-3000:]}\npeer log:\n{log}"
    result = json.loads(run.stdout.strip().splitlines()[-1])

    text, payloads = result["haproxy"]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    assert text and text == result["replica"][0], "Ray's HAProxy changed the replica's greedy completion"
    assert all(json.loads(p)["model"] == SERVED_MODEL_NAME for p in payloads[:-1])
    assert len(result["replica_urls"]) == 1

    assert peer_processes(workdir) == [], "the peer's processes outlived it"
    assert "leftover" not in log, f"the peer had to kill processes Ray's shutdown left:\n{log}"
