"""The rendered Serve config of a team file, deployed through Serve's own declarative API (what `serve deploy` and
KubeRay's serveConfigV2 use), brings up a stack that streams through HAProxy."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from base.contracts import REPLICA_HEADER
from base.waiting import wait_until
from sluice.deploy.apply import delete_apps, render
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port
from tests.support.sse import chunks, data_lines

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_rendered_config_deploys_through_serves_declarative_api(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = yaml.safe_load((ROOT / "topologies" / "teams" / "local-cpu.yaml").read_text())
    port = free_port()
    spec["name"] = "declarative"
    spec["frontend"].update(port=port, metrics_port=free_port())
    spec["models"][0]["replicas"] = 1
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(spec))
    config = yaml.safe_load(render(str(path)))
    apps = [app["name"] for app in config["applications"]]
    register_frontend(port)
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    try:
        body = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        with httpx.Client(timeout=30) as client:

            def streamed() -> tuple[httpx.Response, list] | None:
                try:
                    with client.stream(
                        "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": True}
                    ) as response:
                        if response.status_code == 200:
                            return response, chunks(data_lines(response))
                except httpx.TransportError:
                    pass
                return None

            response, events = wait_until(300, streamed, "the declaratively deployed stack to serve", poll_s=1)
        assert response.headers[REPLICA_HEADER]
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert serve.status().applications[apps[-1]].status == "RUNNING"
    finally:
        delete_apps(apps)
