"""`sluice serve` (what `make serve` runs): prints replica URLs that stream, and Ctrl-C cleans up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import free_port
from tests.integration.sse import chunks, data_lines

pytestmark = pytest.mark.integration

URL = re.compile(r"replica (\S+): (http://127\.0\.0\.1:\d+)/v1/chat/completions")


def _wait_until_ready(process: subprocess.Popen, log: Path, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"sluice serve exited early:\n{log.read_text()[-3000:]}"
        text = log.read_text()
        if "Ctrl-C stops everything" in text:
            return dict(URL.findall(text))
        time.sleep(1)
    raise AssertionError(f"sluice serve never became ready:\n{log.read_text()[-3000:]}")


def test_sluice_serve_streams_and_shuts_down_on_ctrl_c(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "serve", "--serve-proxy-port", str(free_port())],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        urls = _wait_until_ready(process, log, timeout_s=300)
        assert len(urls) == 2
        for replica_id, url in urls.items():
            body = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
                assert response.headers["x-serve-replica"] == replica_id
                assert chunks(data_lines(response))[-1]["choices"][0]["finish_reason"] == "length"
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert descendants, "the cluster runs as children of sluice serve"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left behind after Ctrl-C: {[p.pid for p in alive]}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
