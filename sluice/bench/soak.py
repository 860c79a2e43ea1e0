"""The soak (`make soak`, `sluice bench soak`): a stack under the `mixed` campaign for `duration_s`, with clients that
leave mid-stream all along, one LLM replica killed at a quarter of the run, a scale 2 -> 3 at 45 % and back to 2 at
70 %. Then what must hold and what is measured:

- invariants: the capacity ledger holds no token once the load is over (`ledger_outstanding` 0), HAProxy's replica
  servers UP are the live replicas (`servers_match`), every non-2xx carries its reason, and every request that got
  no response at all was in flight when the replica was killed (`no_response` empty);
- figures: requests, non-2xx by status and reason, the requests lost with the killed replica (streams cut after their
  headers; before them, `lost_at_kill`: HAProxy closes a kept-alive client connection without a status, a new one
  gets 502 `replica_failed`), clients that left, and the RSS of HAProxy, each router and each LLM replica at start,
  after the warm-up and at the end, with its growth per hour, and their private memory after the warm-up and at the end;
- memory, in a run of `MEMORY_JUDGED_FROM_S` or longer: after the warm-up (`WARMUP_SHARE` of the run) the private
  memory (RSS less file-backed pages: code and libraries paged in as new paths first run, which no leak makes) of
  HAProxy, the frontend replica and each router may grow by `MAX_RSS_GROWTH` at most to the end (an LLM replica's is
  reported: the engine's caches fill with the traffic). A shorter run (CI's 90 s) reports it without judging: its
  warm-up is too short to tell a leak from a filling cache.

The stack runs `capacity_queue` (the policy with a ledger). Loopback only; every loop is bounded by the duration.
"""

from __future__ import annotations

import csv
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from base import sse
from base.contracts import SESSION_HEADER_DEFAULT
from base.waiting import WaitTimeout, wait_until
from loadtests.campaign import Campaign, run
from loadtests.sse_timing import StreamRow
from routers.capacity_queue import NAME as CAPACITY_QUEUE
from sluice.bench.stack_variants import deploy_variant, kill_one_replica, ledger_snapshot, non_2xx

# When each disturbance lands, as a share of the duration.
KILL_AT, SCALE_UP_AT, SCALE_DOWN_AT = 0.25, 0.45, 0.7
USERS = 4  # the campaign's closed-loop users (2 cores serve 2-3 tiny replicas)
LEAVE_EVERY_S = 0.5  # a client that leaves after its first event, this often
SETTLE_S = 60.0  # how long the invariants may take to hold once the load is over
SETTLE_POLL_S = 0.5
# A request with no response sent this close to the kill was in flight at the killed replica (its engine's longest
# wait for a first token here is well under it); one outside it is a fault of the stack.
KILL_LOSS_WINDOW_S = 5.0
# The load's client (requests) names a connection closed before any response this way.
CLOSED_WITHOUT_RESPONSE = "ConnectionError"
# Memory: the share of the run taken as warm-up, the growth allowed after it, and the shortest run judged.
WARMUP_SHARE = 0.2
MAX_RSS_GROWTH = 0.05
MEMORY_JUDGED_FROM_S = 600.0
# Processes whose memory is judged (by name prefix in `rss_mb`): the data plane's, never an engine's.
JUDGED_PROCESSES = ("haproxy", "frontend:", "router:")


def _leaving_clients(url: str, model: str, stop: threading.Event, left: list[int]) -> None:
    """Open a stream, read its first event, hang up; again every `LEAVE_EVERY_S` until `stop`."""
    body = {"model": model, "messages": [{"role": "user", "content": "leave"}], "max_tokens": 128, "stream": True}
    with httpx.Client(timeout=30) as client:
        while not stop.wait(LEAVE_EVERY_S):
            try:
                with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    next(sse.iter_lines(response.iter_bytes()), None)
                left.append(response.status_code)
            except httpx.HTTPError:
                left.append(0)


def _processes(plan: Any, frontend: dict[str, Any]) -> dict[str, psutil.Process]:
    """HAProxy's worker, each router replica and each LLM replica (Ray titles a replica's process
    `ray::ServeReplica:<app>:<deployment>`), by name."""
    found = {"haproxy": psutil.Process(frontend["worker_pid"] or frontend["master_pid"])}
    if frontend.get("replica_pid"):
        found[f"frontend:{frontend['replica_pid']}"] = psutil.Process(frontend["replica_pid"])
    roles = {plan.models[0].router_app: "router", plan.models[0].llm_app: "replica"}
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(process.info["cmdline"] or [])
        for app, role in roles.items():
            if title.startswith(f"ray::ServeReplica:{app}:"):
                found[f"{role}:{process.info['pid']}"] = process
    return found


def _memory_mb(plan: Any) -> dict[str, tuple[float, float]]:
    """Each process's (resident, private) MB with its children's; private is resident less file-backed pages: code and
    libraries paged in as new paths first run (a kill, a scale), which no leak makes."""
    memory = {}
    for name, process in _processes(plan, _frontend(plan)).items():
        try:
            infos = [p.memory_info() for p in (process, *process.children(recursive=True))]
        except psutil.Error:
            continue
        memory[name] = (sum(i.rss for i in infos) / 2**20, sum(i.rss - i.shared for i in infos) / 2**20)
    return memory


def _frontend(plan: Any) -> dict[str, Any]:
    from sluice.deploy.apply import frontend_status

    return frontend_status(plan) or {}


def _ledger_outstanding(plan: Any) -> int:
    return int(ledger_snapshot(plan)["outstanding"])


def _servers_match(plan: Any) -> bool:
    """Every live replica UP in HAProxy's map and nothing else (what `sluice check` asks)."""
    from sluice.deploy.apply import frontend_status
    from sluice.deploy.check.checklist import server_map

    return server_map(frontend_status(plan), plan)[0]


def _holds_within(check: Callable[[], bool], what: str) -> bool:
    """Whether `check()` holds within `SETTLE_S` of the load's end."""
    try:
        return wait_until(SETTLE_S, check, what, SETTLE_POLL_S)
    except WaitTimeout:
        return False


def _memory_figures(
    start: tuple[float, float], warm: tuple[float | None, float | None], end: tuple[float, float], hours: float
) -> dict[str, float | None]:
    """One process's (resident, private) MB at start, after the warm-up and at the end, as `soak.json` reports them."""
    return {
        "start": start[0],
        "warm": warm[0],
        "end": end[0],
        "growth_per_hour": (end[0] - start[0]) / hours,
        "private_warm": warm[1],
        "private_end": end[1],
    }


def soak(
    spec_path: Path, out: Path, tokenizer: Path, duration_s: float, wait_for_delete: bool = True
) -> dict[str, Any]:
    """Run the soak on the connected Ray cluster; returns (and writes to `out/soak.json`) its figures. The stack is
    deleted at the end (`wait_for_delete` False: the deletions only issued, as a test's teardown does)."""
    data = yaml.safe_load(spec_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    plan = deploy_variant(data, CAPACITY_QUEUE, 2)
    model = plan.models[0].name
    started = time.monotonic()
    before = _memory_mb(plan)
    campaign = Campaign(
        workload="mixed",
        target=plan.url,
        out=out / "campaign",
        tokenizer=tokenizer,
        duration_s=duration_s,
        users=USERS,
        model=model,
        session_header=SESSION_HEADER_DEFAULT,
        seed=int(time.time()),
    )
    load = threading.Thread(target=run, args=(campaign,))
    stop, left = threading.Event(), []
    leaving = threading.Thread(target=_leaving_clients, args=(plan.url, model, stop, left))
    load.start()
    leaving.start()
    events = []
    kill_window = (0.0, 0.0)
    warm: dict[str, tuple[float, float]] = {}
    try:
        for at, action in (
            (WARMUP_SHARE, "warmed up"),
            (KILL_AT, "kill"),
            (SCALE_UP_AT, "scale to 3"),
            (SCALE_DOWN_AT, "scale to 2"),
        ):
            time.sleep(max(0.0, started + at * duration_s - time.monotonic()))
            if action == "warmed up":
                warm = _memory_mb(plan)
            elif action == "kill":
                # The campaign's rows are stamped with time.perf_counter (a monotonic clock across this machine).
                kill_started = time.perf_counter()
                events.append({"at_s": time.monotonic() - started, "action": f"killed {kill_one_replica(plan)}"})
                kill_window = (kill_started - KILL_LOSS_WINDOW_S, time.perf_counter() + KILL_LOSS_WINDOW_S)
            else:
                plan = deploy_variant(data, CAPACITY_QUEUE, 3 if action == "scale to 3" else 2)
                events.append({"at_s": time.monotonic() - started, "action": action})
        load.join(timeout=duration_s + 600)
    finally:
        stop.set()
        leaving.join(timeout=60)
    hours = (time.monotonic() - started) / 3600
    after = _memory_mb(plan)
    rows = [StreamRow.from_csv(row) for row in _csv_rows(campaign.out / "rows.csv")]
    drained = _holds_within(lambda: _ledger_outstanding(plan) == 0, "the ledger to drain")
    figures = {
        "duration_s": duration_s,
        "events": events,
        **request_figures(rows, kill_window),
        "clients_left": len(left),
        "ledger_outstanding": 0 if drained else _ledger_outstanding(plan),
        "servers_match": _holds_within(lambda: _servers_match(plan), "HAProxy's servers to match the replicas"),
        "rss_mb": {
            name: _memory_figures(before[name], warm.get(name, (None, None)), after[name], hours)
            for name in before.keys() & after.keys()
        },
    }
    (out / "soak.json").write_text(json.dumps(figures, indent=2))
    from sluice.deploy.apply import delete_plan

    delete_plan(plan, wait=wait_for_delete)
    return figures


def request_figures(rows: list[StreamRow], kill_window: tuple[float, float]) -> dict[str, Any]:
    """The load's requests: non-2xx by status and reason, streams cut after their headers, requests lost with the
    killed replica before them (`kill_window`: the `perf_counter` span around the kill), and any other request that
    got no response, by the client's error."""
    lost: list[StreamRow] = []
    unexplained: list[StreamRow] = []
    for row in rows:
        if row.status == 0:
            (lost if _lost_with_the_killed_replica(row, kill_window) else unexplained).append(row)
    return {
        "requests": len(rows),
        "non_2xx": non_2xx((r.status, r.reason) for r in rows),
        "cut_streams": sum(1 for r in rows if r.status == 200 and r.error),
        "lost_at_kill": len(lost),
        "no_response": dict(Counter(r.error or "-" for r in unexplained)),
    }


def broken_invariants(figures: dict[str, Any]) -> list[str]:
    """What of the soak's invariants did not hold, in words (empty: all held)."""
    broken = []
    if figures["ledger_outstanding"]:
        broken.append(f"the capacity ledger still holds {figures['ledger_outstanding']} tokens")
    if not figures["servers_match"]:
        broken.append("HAProxy's UP replica servers are not the live replicas")
    if without_reason := [key for key in figures["non_2xx"] if key.endswith(" -")]:
        broken.append(f"non-2xx without a reason: {without_reason}")
    if figures["no_response"]:
        broken.append(f"requests with no response away from the kill: {figures['no_response']}")
    if figures.get("duration_s", 0) >= MEMORY_JUDGED_FROM_S:
        for name, rss in figures.get("rss_mb", {}).items():
            warm, end = rss.get("private_warm"), rss["private_end"]
            if name.startswith(JUDGED_PROCESSES) and warm and end > warm * (1 + MAX_RSS_GROWTH):
                grown = 100 * (end / warm - 1)
                broken.append(
                    f"{name}'s private memory grew {grown:.1f} % after the warm-up ({warm:.1f} -> {end:.1f} MB)"
                )
    return broken


def _lost_with_the_killed_replica(row: StreamRow, kill_window: tuple[float, float]) -> bool:
    """A request whose connection closed before any response, sent while the killed replica could have taken it."""
    return row.error == CLOSED_WITHOUT_RESPONSE and kill_window[0] <= row.sent_at <= kill_window[1]


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))
