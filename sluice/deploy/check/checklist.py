"""`sluice check [FILE | --target URL]`: the adoption checklist, one verdict. It observes and never changes a stack.

`pass` (exit 0) only when every item ran and passed, `incomplete` (exit 4) when none failed but some were skipped,
`fail` (exit 1) when any failed; `--allow-skip ITEM` accepts a skip. The items: `sluice/deploy/README.md`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import httpx

from base.contracts import (
    DIRECT_PATH,
    FAULT_PATH,
    REASON_INJECTED_FAULT,
    SERVE_PATH_HEADER,
    SERVE_REASON_HEADER,
    TABLE_LEASE_S,
)
from base.quantiles import quantile
from services.internal_credential import internal_headers
from sluice.deploy.check import items as check_items
from sluice.deploy.check.contract import api_contract
from sluice.deploy.check.items import Result, chat, check_client, direct_post, headers
from sluice.deploy.check.startup import NO_FRONTEND_STATUS, startup_path
from sluice.deploy.check.versions import versions
from sluice.deploy.errors import require_url, served_models
from sluice.deploy.exit_codes import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK
from sluice.deploy.json_reports import CheckReport, Verdict

if TYPE_CHECKING:
    from builders.plan import StackPlan
    from topologies.spec import StackBase

FAULT_SECONDS = 5.0
SAMPLES = 8
# How long the frontend may take to report its status (HAProxy's servers) under load.
FRONTEND_STATUS_TIMEOUT_S = 30.0

VERDICT_PASS, VERDICT_INCOMPLETE, VERDICT_FAIL = Verdict.PASS, Verdict.INCOMPLETE, Verdict.FAIL
CHECK_EXIT_PASS = EXIT_OK
CHECK_EXIT_FAIL = EXIT_FAILED
CHECK_EXIT_INCOMPLETE = EXIT_INCOMPLETE
EXIT_CODES = {VERDICT_PASS: CHECK_EXIT_PASS, VERDICT_INCOMPLETE: CHECK_EXIT_INCOMPLETE, VERDICT_FAIL: CHECK_EXIT_FAIL}

# The items, in the order they run (a per-model item is reported as `<name> (<model>)`): what `--allow-skip` takes.
VERSIONS = "versions"
STARTUP_PATH = "startup path"
DIRECT_STREAMING = "direct streaming"
SERVER_MAP = "server map"
SERVED_IS_CHOSEN = "served replica is the chosen one"
FAULT_INJECTION = "fault injection"
API_CONTRACT = "API contract"
DISCONNECT = "disconnect frees the engine"
TIMEOUT_CLEANUP = "timeout cleanup"
LEGACY_SAME_TEXTS = "legacy path, same texts"
ITEMS = (
    VERSIONS,
    STARTUP_PATH,
    DIRECT_STREAMING,
    SERVER_MAP,
    SERVED_IS_CHOSEN,
    FAULT_INJECTION,
    API_CONTRACT,
    DISCONNECT,
    TIMEOUT_CLEANUP,
    LEGACY_SAME_TEXTS,
)
# What runs an item that a stack's spec made skip.
ENABLED_BY = {
    FAULT_INJECTION: "spec setting `staging: true`",
    TIMEOUT_CLEANUP: "spec setting `staging: true`",
    LEGACY_SAME_TEXTS: "spec setting `ingress.mode: both` or `legacy` (a mode that retains the legacy path)",
}
# Why `--target` skips the items only a stack's spec file runs, and what runs them.
NEEDS_SPEC_REASON = "needs the stack's spec file (not --target)"
NEEDS_SPEC_ENABLED_BY = "give the stack's spec file instead of --target"


@dataclass
class Item:
    item: str
    ok: bool | None  # None: skipped
    detail: str  # a skipped item: why
    # A skipped item: the flag or spec setting that runs it, and whether the user accepts the skip (`--allow-skip`).
    enable_with: str | None = None
    allowed: bool = False


def allowed_skips(names: Iterable[str]) -> frozenset[str]:
    """The item names a user accepts as skipped; ValueError naming the valid ones for any other name."""
    allowed = frozenset(names)
    unknown = sorted(allowed - set(ITEMS))
    if unknown:
        valid = ", ".join(map(repr, ITEMS))
        raise ValueError(f"no check item {', '.join(map(repr, unknown))} to allow skipped: the items are {valid}")
    return allowed


def server_map(frontend: dict[str, Any] | None, plan: StackPlan) -> Result:
    from services.serve_internals import list_replica_endpoints

    if frontend is None:
        return False, NO_FRONTEND_STATUS
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


def fault_injection(client: httpx.Client, base: str, spec: StackBase, plan: StackPlan) -> Result:
    if not spec.staging:
        return None, "not a staging stack (only a staging stack's routers can be made to fail)"
    from services.serve_internals import list_replica_endpoints

    first = plan.models[0]
    # Each router replica's app on Serve's port (HAProxy's route calls go to the route agents).
    urls = [f"{e.url}/{first.router_app}{FAULT_PATH}" for e in asyncio.run(list_replica_endpoints(first.router_app))]
    for url in urls:
        client.post(url, json={"seconds": FAULT_SECONDS}, headers=internal_headers()).raise_for_status()
    if spec.routing.table_decisions:
        # The frontend's threads drop the faulty routers' table at their next fetch, within a lease.
        time.sleep(TABLE_LEASE_S)
    try:
        response = direct_post(client, f"{base}/v1/chat/completions", chat(first.name))
    finally:
        for url in urls:
            client.post(url, json={"seconds": 0}, headers=internal_headers())
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
        legacy_url = f"{legacy[0].url}/{model.legacy_app}/v1/chat/completions"
        old = client.post(legacy_url, json=body, headers={**headers(), **internal_headers()})
        if direct is None or direct.status_code != 200 or old.status_code != 200:
            return False, f"{prompt!r}: direct {direct and direct.status_code}, legacy {old.status_code}"
        texts = [r.json()["choices"][0]["message"]["content"] for r in (direct, old)]
        if texts[0] != texts[1] or old.headers.get(SERVE_PATH_HEADER) != "legacy":
            return False, f"{prompt!r}: direct {texts[0]!r}, legacy {texts[1]!r}"
    return True, f"{len(prompts)} greedy requests, the same texts on both paths"


def run_checks(
    spec: StackBase | None,
    plan: StackPlan | None,
    base: str,
    allow_skip: Iterable[str] = (),
    expected_versions: dict[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
    headers: dict[str, str] | None = None,
) -> list[Item]:
    items: list[Item] = []
    allowed = allowed_skips(allow_skip)

    def skipped(name: str, label: str, reason: str, enable_with: str) -> Item:
        return Item(label, None, reason, enable_with, name in allowed)

    def record(name: str, check: Callable[..., Result], *args: Any, model: str | None = None) -> None:
        label = name if model is None else f"{name} ({model})"
        try:
            ok, detail = check(*args)
        except Exception as error:  # an item that cannot run fails, naming why
            ok, detail = False, f"{type(error).__name__}: {error}"
        items.append(skipped(name, label, detail, ENABLED_BY[name]) if ok is None else Item(label, ok, detail))

    with check_client(verify, headers) as client:
        model = plan.models[0].name if plan else client.get(f"{base}/v1/models").json()["data"][0]["id"]
        frontend = handle = replica_apps = None
        metrics_urls = [f"{base}/metrics"]
        if plan is not None:
            from ray import serve

            from services.serve_internals import list_replica_endpoints
            from sluice.deploy.apply import frontend_status

            handle = serve.get_app_handle(plan.frontend_app)
            frontend = frontend_status(plan, FRONTEND_STATUS_TIMEOUT_S)
            # Each LLM replica's app on its own port, by `<model> replica <id>`.
            replica_apps = {
                f"{m.name} replica {e.replica_id}": f"{e.url}/{m.llm_app}"
                for m in plan.models
                for e in asyncio.run(list_replica_endpoints(m.llm_app))
            }
            metrics_urls = [f"{app}/metrics" for app in replica_apps.values()]
        record(VERSIONS, versions, client, base, replica_apps, expected_versions or {})
        if plan is not None:
            from sluice.deploy.status import routers_report

            record(STARTUP_PATH, startup_path, frontend, plan, routers_report)
        else:
            items.append(skipped(STARTUP_PATH, STARTUP_PATH, NEEDS_SPEC_REASON, NEEDS_SPEC_ENABLED_BY))
        if plan is None:
            record(DIRECT_STREAMING, check_items.direct_streaming, client, base, model)
        for planned in plan.models if plan else []:
            record(DIRECT_STREAMING, check_items.direct_streaming, client, base, planned.name, model=planned.name)
        if plan is not None:
            record(SERVER_MAP, server_map, frontend, plan)
            record(SERVED_IS_CHOSEN, served_is_chosen, client, base, model, handle)
            record(FAULT_INJECTION, fault_injection, client, base, spec, plan)
        else:
            needs_spec = (SERVER_MAP, SERVED_IS_CHOSEN, FAULT_INJECTION)
            items += [skipped(n, n, NEEDS_SPEC_REASON, NEEDS_SPEC_ENABLED_BY) for n in needs_spec]
        first = spec.models[0] if spec is not None else None  # type: ignore[attr-defined]
        tool_calls = first is None or first.tool_call_parser(first.source) is not None
        record(API_CONTRACT, api_contract, client, base, model, tool_calls)
        record(DISCONNECT, check_items.disconnect_frees_engine, client, base, model, metrics_urls)
        if plan is not None:
            staging = spec is not None and spec.staging
            record(TIMEOUT_CLEANUP, check_items.timeout_cleanup, client, base, model, metrics_urls, staging)
        else:
            items.append(skipped(TIMEOUT_CLEANUP, TIMEOUT_CLEANUP, NEEDS_SPEC_REASON, NEEDS_SPEC_ENABLED_BY))
        if plan is not None:
            for planned in plan.models:
                record(LEGACY_SAME_TEXTS, legacy_same_texts, client, base, planned, model=planned.name)
        else:
            items.append(skipped(LEGACY_SAME_TEXTS, LEGACY_SAME_TEXTS, NEEDS_SPEC_REASON, NEEDS_SPEC_ENABLED_BY))
    return items


def verdict(items: list[Item]) -> dict[str, Any]:
    """The checklist as JSON: the verdict, the failed items by name, the skipped ones (why, what runs them, whether
    the user allowed the skip), and every item."""
    failed = [item.item for item in items if item.ok is False]
    skipped = [
        {"item": i.item, "reason": i.detail, "enable_with": i.enable_with, "allowed": i.allowed}
        for i in items
        if i.ok is None
    ]
    outcome = VERDICT_FAIL if failed else VERDICT_INCOMPLETE if any(not s["allowed"] for s in skipped) else VERDICT_PASS
    return {"verdict": outcome, "failed": failed, "skipped": skipped, "items": [asdict(i) for i in items]}


def _verdict_line(result: dict[str, Any]) -> str:
    skipped = [s["item"] for s in result["skipped"] if not s["allowed"]]
    allowed = [s["item"] for s in result["skipped"] if s["allowed"]]
    if result["verdict"] == VERDICT_FAIL:
        return f"verdict: FAIL ({', '.join(result['failed'])})"
    if result["verdict"] == VERDICT_INCOMPLETE:
        return (
            f"verdict: INCOMPLETE ({len(skipped)} skipped: {'; '.join(skipped)}): run them with the setting named, "
            "or accept each with --allow-skip ITEM"
        )
    return f"verdict: PASS (skips allowed: {'; '.join(allowed)})" if allowed else "verdict: PASS"


def report(items: list[Item], as_json: bool) -> int:
    """Print the checklist (a table, or JSON); the exit code: `CHECK_EXIT_PASS`, `_INCOMPLETE` or `_FAIL`."""
    result = verdict(items)
    if as_json:
        print(CheckReport.model_validate(result).model_dump_json(indent=2))
    else:
        width = max(len(item.item) for item in items)
        for item in items:
            mark = "SKIP" if item.ok is None else "PASS" if item.ok else "FAIL"
            detail = item.detail
            if item.ok is None:
                detail += f"; runs with: {item.enable_with}" + (" (skip allowed)" if item.allowed else "")
            print(f"{mark:4}  {item.item:<{width}}  {detail}")
        print(f"\n{_verdict_line(result)}")
    return EXIT_CODES[result["verdict"]]


def check(
    path: str | None,
    target: str | None,
    address: str,
    as_json: bool,
    allow_skip: Iterable[str] = (),
    expected_versions: dict[str, str] | None = None,
    ca_file: str | None = None,
    headers: dict[str, str] | None = None,
) -> int:
    """Run the checklist and print it; the exit code. ValueError (before anything runs) for an unknown
    `allow_skip` item. `expected_versions`: `ray` / `vllm` -> the version every replica (and this CLI) must run.
    `ca_file`: the CA an https frontend's certificate is checked against (default: the system's). `headers`: what
    every request to the frontend carries (a keyed stack's API key)."""
    allowed = allowed_skips(allow_skip)
    verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
    if target is not None:
        target = require_url("--target", target)
        served_models(target, verify, headers)
        return report(run_checks(None, None, target, allowed, expected_versions, verify, headers), as_json)
    from sluice.deploy.apply import connect, frontend_url, plan_of

    spec, plan = plan_of(path)
    connect(address)
    checked = run_checks(spec, plan, frontend_url(plan), allowed, expected_versions, verify, headers)
    return report(checked, as_json)
