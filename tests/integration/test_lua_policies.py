"""One source for the Lua policies: the frontend's table decisions (infra/haproxy/route_tables.lua.tmpl, rendered as
HAProxy loads it) pick what the Python policies pick, on 10,000 keys.

A real HAProxy loads the rendered route chunk with a check service appended to it (so the chunk's local `build_ring`,
`ring_walk` and `rotation_walk` are in scope) and answers, for the router's own table of a replica set, the ranked
ids of each key (ring) or of each next decision (rotation). The same table comes from the router's
`table_answer`, and the Python side from the registry's consistent_hash and round_robin, deciding as the router
does."""

from __future__ import annotations

import random
import string
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import HAProxySettings
from infra.haproxy.lua import render_lua
from infra.haproxy.process import find_haproxy_binary
from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.core import ReplicaView, RouteRequest
from routers.registry import build_policy, table_of
from routers.round_robin import NAME as ROUND_ROBIN
from services.router.route_table import table_answer
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

KEYS = 10_000
REPLICAS = 16
SEED = 20261207
CHECK_SERVICE = "sluice_policy_check"
# The check service: the body is the table's kind, its fallbacks and its ids (one line, space separated), then one
# key a line (a ring's hash keys; a rotation's lines only count its decisions). The answer: each ranking, one a line.
CHECK_LUA = (
    """
core.register_service("CHECK_SERVICE", "http", function(applet)
    local body = applet:receive()
    local lines = {}
    for line in body:gmatch("([^\\n]*)\\n") do
        lines[#lines + 1] = line
    end
    local kind, fallbacks, list = lines[1]:match("^(%S+) (%d+) (.*)$")
    local ids = {}
    for id in list:gmatch("%S+") do
        ids[#ids + 1] = id
    end
    local tbl = {kind = kind, fallbacks = tonumber(fallbacks), ids = ids, cursor = 0}
    if kind == TABLE_RING then
        tbl.ring = build_ring(ids)
    end
    local out = {}
    for i = 2, #lines do
        local ranked = kind == TABLE_RING and ring_walk(tbl, lines[i]) or rotation_walk(tbl)
        out[#out + 1] = table.concat(ranked, " ")
    end
    local answer = table.concat(out, "\\n") .. "\\n"
    applet:set_status(200)
    applet:add_header("content-length", tostring(#answer))
    applet:start_response()
    applet:send(answer)
end)
"""
).replace("CHECK_SERVICE", CHECK_SERVICE)


@pytest.fixture(scope="module")
def lua_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real HAProxy with the rendered route chunk plus the check service, on a loopback port."""
    workdir = tmp_path_factory.mktemp("lua-policies")
    settings = HAProxySettings(workdir=workdir, apps=[AppRoute(name="lua-check")], port=free_port(), prometheus_port=1)
    settings.weights_map_path.write_text("")
    chunk = workdir / "route.lua"
    chunk.write_text(render_lua(settings) + CHECK_LUA)
    port = free_port()
    config = workdir / "haproxy.cfg"
    config.write_text(
        "global\n"
        f"    lua-load {chunk}\n"
        "    tune.bufsize 1048576\n"
        "defaults\n"
        "    mode http\n"
        "    timeout connect 5s\n"
        "    timeout client 30s\n"
        "    timeout server 30s\n"
        "frontend check\n"
        f"    bind 127.0.0.1:{port}\n"
        f"    http-request use-service lua.{CHECK_SERVICE}\n"
    )
    haproxy = subprocess.Popen([str(find_haproxy_binary()), "-db", "-f", str(config)], stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/"
    try:

        def serving() -> bool:
            assert haproxy.poll() is None, haproxy.stderr.read().decode() if haproxy.stderr else "haproxy exited"
            try:
                return httpx.post(url, content=b"rotation 0 a\n", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(15, serving, "HAProxy with the check service to answer", poll_s=0.1)
        yield url
    finally:
        haproxy.terminate()
        try:
            haproxy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            haproxy.kill()
            haproxy.wait()


def _views(rng: random.Random) -> list[ReplicaView]:
    """Replica ids shaped as Serve's (random hex), so the ring's order is not the ids' order."""
    return [ReplicaView(replica_id="".join(rng.choices("0123456789abcdef", k=8)), capacity=8) for _ in range(REPLICAS)]


def _keys(rng: random.Random) -> list[str]:
    """Session ids of every length the hash's tail handles (1 to 48 bytes), UTF-8 beyond ASCII included."""
    alphabet = string.ascii_letters + string.digits + "-_.:éß中"
    return ["".join(rng.choices(alphabet, k=rng.randint(1, 48))) for _ in range(KEYS)]


def _lua_rankings(url: str, policy: str, views: list[ReplicaView], keys: list[str]) -> list[list[str]]:
    status, table = table_answer(table_of(policy, {}), views, faulty=False)
    assert status == 200
    header = f"{table.kind} {table.fallbacks} {' '.join(table.replica_ids)}"
    body = "\n".join([header, *keys]) + "\n"
    began = time.monotonic()
    answer = httpx.post(url, content=body.encode(), timeout=60)
    assert answer.status_code == 200, answer.text[:500]
    print(f"{policy}: {len(keys)} Lua rankings in {time.monotonic() - began:.2f} s")
    return [line.split(" ") for line in answer.text.splitlines()]


def test_the_lua_ring_picks_what_consistent_hash_picks_on_10000_keys(lua_url: str) -> None:
    rng = random.Random(SEED)
    views, keys = _views(rng), _keys(rng)
    policy = build_policy(CONSISTENT_HASH, {})
    python = [policy.rank(views, RouteRequest(request_id="r", session_id=key)) for key in keys]
    expected = [[tier[0].replica_id for tier in ranking] for ranking in python]
    lua = _lua_rankings(lua_url, CONSISTENT_HASH, views, keys)
    differing = [(key, want, got) for key, want, got in zip(keys, expected, lua, strict=True) if want != got]
    assert not differing, f"{len(differing)} of {KEYS} keys differ, e.g. {differing[:3]}"
    assert len({ranking[0] for ranking in lua}) == REPLICAS, "every replica owns some keys"


def test_the_lua_rotation_ranks_what_round_robin_ranks_for_10000_decisions(lua_url: str) -> None:
    views = _views(random.Random(SEED + 1))
    policy = build_policy(ROUND_ROBIN, {})
    python = [policy.rank(views, RouteRequest(request_id=f"r{i}")) for i in range(KEYS)]
    expected = [[tier[0].replica_id for tier in ranking] for ranking in python]
    lua = _lua_rankings(lua_url, ROUND_ROBIN, views, [f"r{i}" for i in range(KEYS)])
    assert lua == expected
