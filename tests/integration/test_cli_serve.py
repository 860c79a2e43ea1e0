"""`sluice serve` (what `make serve` runs) with a policy flag and TLS, in one run: HAProxy streams from both replicas,
`sluice status` reports the policy the routers run (the flag's, not the file's), the openai client and `sluice check`
pass over TLS, and Ctrl-C cleans up. Plain-HTTP frontends are what every other stack in the suite serves."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from base.waiting import WaitTimeout, wait_until
from sluice.deploy.check.checklist import API_CONTRACT, DIRECT_STREAMING
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port
from tests.support.sse import chunks, data_lines
from topologies import EMBEDDED_SPEC

pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

URL = re.compile(r"sluice is serving at (https?://127\.0\.0\.1:\d+):")
CA = re.compile(r"clients trust (\S+) ")
STATUS = re.compile(r"sluice status (\S+) --address (\S+)")


def _wait_until_ready(process: subprocess.Popen, log: Path, timeout_s: float) -> tuple[str, tuple[str, str]]:
    """The frontend's URL and the `sluice status` command `sluice serve` printed (stack, address)."""

    def ready() -> str | None:
        assert process.poll() is None, f"sluice serve exited early:\n{log.read_text()[-3000:]}"
        text = log.read_text()
        return text if "Ctrl-C stops everything" in text else None

    try:
        text = wait_until(timeout_s, ready, "sluice serve to be ready", poll_s=1)
    except WaitTimeout:
        raise AssertionError(f"sluice serve never became ready:\n{log.read_text()[-3000:]}") from None
    return URL.findall(text)[0], STATUS.findall(text)[0]


def _serve(log: Path, port: int, *flags: str) -> subprocess.Popen:
    """`sluice serve` with the frontend on `port` (and free ports for the rest), its output to `log`."""
    register_frontend(port)
    with log.open("w") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "sluice.cli.main", "serve", "--serve-proxy-port", str(free_port())),
                *("--port", str(port), "--prometheus-port", str(free_port()), *flags),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def _status(target: str, address: str) -> dict:
    command = [sys.executable, "-m", "sluice.cli.main", "status", target, "--address", address, "--json"]
    status = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert status.stdout, status.stderr
    return json.loads(status.stdout)


def test_sluice_serve_streams_over_tls_passes_the_contract_check_and_shuts_down_on_ctrl_c(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`sluice serve --tls-self-signed --policy consistent_hash`: status reports the flag's policy and its difference
    from the file; streams spread over both replicas; the official openai client, given the CA, streams over TLS;
    `sluice check --target https://... --ca-file` passes the API contract item; plain HTTP on the port is not served;
    Ctrl-C ends every process it started."""
    log, port = tmp_path / "serve.log", free_port()
    process = _serve(log, port, "--tls-self-signed", "--policy", "consistent_hash")
    try:
        url, (stack, address) = _wait_until_ready(process, log, timeout_s=300)
        assert url == f"https://127.0.0.1:{port}"
        ca = CA.findall(log.read_text())[0]
        report = _status(stack, address)
        assert report["models"]["sluice-tiny"]["routers"]["policy"] == "consistent_hash"
        # The embedded file says round_robin: status names the difference.
        against_file = _status(str(EMBEDDED_SPEC), address)["differences"]
        assert "sluice-tiny: policy round_robin in the file, consistent_hash running" in against_file
        served = set()
        body = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        body["ignore_eos"] = True
        body["stream"] = True
        with httpx.Client(verify=ca, timeout=60) as https:
            for _ in range(16):  # no session header: hashed by request id, over both replicas (all on one: p = 3e-5)
                with https.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    served.add(response.headers["x-serve-replica"])
                    assert chunks(data_lines(response))[-1]["choices"][0]["finish_reason"] == "length"
        assert len(served) == 2
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=httpx.Client(verify=ca, timeout=60)
        )
        assert [model.id for model in client.models.list()] == ["sluice-tiny"]
        stream = client.chat.completions.create(
            model="sluice-tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finishes = [choice.finish_reason for chunk in stream for choice in chunk.choices]
        assert finishes[-1] == "length"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
        command = [sys.executable, "-m", "sluice.cli.main", "check", "--target", url, "--ca-file", ca, "--json"]
        checked = subprocess.run(command, capture_output=True, text=True, timeout=300)
        items = {item["item"]: item for item in json.loads(checked.stdout)["items"]}
        assert items[API_CONTRACT]["ok"] is True, items[API_CONTRACT]
        assert items[DIRECT_STREAMING]["ok"] is True, items[DIRECT_STREAMING]
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
