"""HAProxy's side of the route agent (SPOE): the SPOE file, the frontend's filter and rules, the agents' backend.

Per app, an SPOE engine whose agent is the app's router replicas' route agents (`services.router.route_listener`),
reached over persistent, pipelined connections from each HAProxy thread. The Lua route action prepares a routed
request (its forwarded body and truncation in variables) and names the app in `VAR_ASK_AGENT`; the rule after it
sends that app's message; the reply action then reads the variables the agent set (`base.agent_wire`) or the
error HAProxy set. An app whose agents' backend has no usable server (routers that have not told their agent's port
yet, or stand-ins that speak only HTTP), or no router UP at Serve's port (the operator's switch: maintenance there
takes the app off its agents too), is routed with the HTTP route call instead. A tracing frontend also hands the
request's `traceparent` to the agent and registers the variable of the one it answers. Why: infra/haproxy/README.md.
"""

from __future__ import annotations

from base import agent_wire
from base.contracts import BODY_TRUNCATED_HEADER, FRONTEND_HEADER, REQUEST_ID_HEADER, TRACEPARENT_HEADER
from infra.haproxy.canary import health_check_lines
from infra.haproxy.config import HAProxySettings
from infra.haproxy.formatting import counter_table_lines, haproxy_time

AGENT_BACKEND = "sluice_route_agents"
ENGINE = "sluice_route"
LUA_REPLY_ACTION = "sluice_route_reply"
# Set by the route action: the index of the app whose agent the request asks, and what the message carries.
VAR_ASK_AGENT = "txn.sluice_ask_agent"
VAR_AGENT_BODY = "txn.sluice_agent_body"
VAR_AGENT_TRUNCATED = "txn.sluice_agent_truncated"
# When the route call started (µs), for the route time the reply action logs.
VAR_ROUTE_STARTED_US = "txn.sluice_route_started_us"
# An idle connection to an agent is closed after this; traffic keeps a connection per HAProxy thread open.
IDLE_TIMEOUT_S = 30.0
# The agent's share of the route timeout. A request sent to an agent that dies with it is only seen failing when
# this runs out (HAProxy 2.8's SPOE does not hand the lost frame to another connection), and the HTTP route call
# to another router then has the rest.
AGENT_TIMEOUT_SHARE = 0.5
# Failed agent exchanges (each then made over HTTP), counted by kind: SPOE's processing timeout, or any other error.
AGENT_FAILURE_TABLE = "sluice_route_agent_failures"
FAILURE_TIMEOUT = "timeout"
FAILURE_ERROR = "error"
AGENT_FAILURES = (FAILURE_TIMEOUT, FAILURE_ERROR)
SPOE_ERROR_TIMEOUT = 1


def agent_timeout_s(route_timeout_s: float) -> float:
    """SPOE's processing timeout: how long HAProxy waits for an agent's answer before the HTTP route call."""
    return route_timeout_s * AGENT_TIMEOUT_SHARE


def agent_backend(index: int) -> str:
    return AGENT_BACKEND if index == 0 else f"{AGENT_BACKEND}_{index}"


def engine(index: int) -> str:
    return f"{ENGINE}_{index}"


def agent_var(name: str) -> str:
    """The transaction variable an agent's `name` lands in."""
    return f"txn.{agent_wire.VAR_PREFIX}.{name}"


def render_spoe(settings: HAProxySettings) -> str:
    """The SPOE file: a scope per app, each with its agent, message and group."""
    lines = ["# Rendered by infra/haproxy/spoe.py from base/agent_wire.py: do not edit by hand."]
    timeout = haproxy_time(agent_timeout_s(settings.route_timeout_s))
    answers = [name for name in agent_wire.ANSWER_VARS if settings.tracing or name != agent_wire.TRACE_VAR]
    variables = " ".join((agent_wire.ERROR_VAR, *answers))
    for index, app in enumerate(settings.apps):
        arguments = [
            f"{FRONTEND_HEADER}=str({settings.frontend_id})",
            f"{REQUEST_ID_HEADER}=req.fhdr({REQUEST_ID_HEADER})",
            f"{BODY_TRUNCATED_HEADER}=var({VAR_AGENT_TRUNCATED})",
            f"{app.session_header}=req.fhdr({app.session_header})",
            f"{agent_wire.BODY_ARG}=var({VAR_AGENT_BODY})",
        ]
        if settings.tracing:
            arguments.append(f"{TRACEPARENT_HEADER}=req.fhdr({TRACEPARENT_HEADER})")
        lines += [
            "",
            f"[{engine(index)}]",
            f"spoe-agent {engine(index)}",
            f"    groups {agent_wire.MESSAGE}",
            f"    option var-prefix {agent_wire.VAR_PREFIX}",
            f"    option set-on-error {agent_wire.ERROR_VAR}",
            f"    register-var-names {variables}",
            f"    timeout hello {timeout}",
            f"    timeout idle {haproxy_time(IDLE_TIMEOUT_S)}",
            f"    timeout processing {timeout}",
            f"    use-backend {agent_backend(index)}",
            f"spoe-message {agent_wire.MESSAGE}",
            f"    args {' '.join(arguments)}",
            f"spoe-group {agent_wire.MESSAGE}",
            f"    messages {agent_wire.MESSAGE}",
        ]
    return "\n".join(lines) + "\n"


def filter_lines(settings: HAProxySettings) -> list[str]:
    return [
        f"    filter spoe engine {engine(index)} config {settings.spoe_path}" for index in range(len(settings.apps))
    ]


def ask_agent_lines(settings: HAProxySettings) -> list[str]:
    """After the route action: the asked app's message, then the reply action."""
    lines = [
        f"    http-request send-spoe-group {engine(index)} {agent_wire.MESSAGE}"
        f" if {{ var({VAR_ASK_AGENT}) -m int eq {index} }}"
        for index in range(len(settings.apps))
    ]
    error = agent_var(agent_wire.ERROR_VAR)
    timed_out = f"{{ var({error}) -m int eq {SPOE_ERROR_TIMEOUT} }}"
    lines += [
        "    # sc2 counts refusals, which never reach a route call.",
        f"    http-request track-sc2 str({FAILURE_TIMEOUT}) table {AGENT_FAILURE_TABLE} if {timed_out}",
        f"    http-request track-sc2 str({FAILURE_ERROR}) table {AGENT_FAILURE_TABLE}"
        f" if {{ var({error}) -m found }} !{timed_out}",
        f"    http-request lua.{LUA_REPLY_ACTION} if {{ var({VAR_ASK_AGENT}) -m found }}",
    ]
    return lines


def failure_table_lines() -> list[str]:
    comment = "Route calls whose agent exchange failed (then made over HTTP), by kind."
    return counter_table_lines(AGENT_FAILURE_TABLE, comment, len(AGENT_FAILURES), key_bytes=16)


def agent_backend_lines(index: int, settings: HAProxySettings) -> list[str]:
    """The app's route agents: SPOP is no HTTP, so the backend is TCP; its health checks ask Serve's port."""
    return [
        f"backend {agent_backend(index)}",
        "    # The routers' route agents (SPOE): persistent connections, one route call per NOTIFY frame.",
        "    mode tcp",
        "    no option http-no-delay",
        "    balance roundrobin",
        f"    timeout connect {haproxy_time(min(settings.route_connect_timeout_s, settings.route_timeout_s))}",
        *health_check_lines(),
        "",
    ]
