"""The Lua of a platform's HAProxy (`platform_admission.lua.tmpl`), rendered from `base.contracts` and the settings.

Admission orders the requests waiting for a model's capacity (its slot server's maxconn): strict priority between
classes (`set-priority-class`, the class index: `PRIORITY_CLASSES[0]` first), then start-time fair queueing between
tenants within a class. Per (slot, class) a virtual time V, per tenant a finish tag F. On arrival a request gets the
start tag S = max(V, F_tenant), then F_tenant = S + COST_MS / weight; its priority offset is floor(S - now). HAProxy
keys its queue on now + offset, so the key is S itself: absolute tags (an offset relative to V broke FIFO order
within a tenant, measured). V moves up to the S of each request whose response headers arrive. A tenant with a
backlog thus has tags COST_MS / weight apart, and a tenant arriving later starts at V, ahead of that backlog: each
tenant gets its weight's share of the model, whatever its number of clients.

Measured with stand-in teams (capacity 4, 0.5 s streams, /work/exp): FIFO gave alpha (4 clients) 21 % of the
completions against beta (16 clients), this 48 %; alpha interactive with 2 clients against beta batch with 16 and
jittered holds: alpha's TTFT p50 0.07 s, beta's 1.73 s.

Constants:
- `COST_MS` (12 ms): the virtual time one request costs a tenant of weight 1. Only its ratio to the bounds below
  matters to the order; at ~80 responses a second V moves about as fast as the clock, so it rarely meets a bound.
- `AHEAD_MS` (60 s): V is kept within [now - 60 s, now + 60 s]; when it runs ahead, V and every F are moved back
  together (a request already queued keeps its key: for that moment the moved tenants are ahead of it).
- `MAX_OFFSET_MS` (524,000 ms): HAProxy's offsets are bounded at +-524,287 ms (half its 20-bit queue clock); a tag
  beyond is queued at the bound (FIFO among such).
"""

from __future__ import annotations

import json
from pathlib import Path
from string import Template

from base.contracts import (
    PRIORITY_CLASSES,
    REASON_MODEL_UNAVAILABLE,
    REASON_QUEUE_TIMEOUT,
)
from infra.haproxy.formatting import openai_error_body
from infra.haproxy.platform_settings import (
    ACCESS_MAP,
    ACCESS_SEPARATOR,
    LUA_ADMIT_ACTION,
    LUA_ADMITTED_ACTION,
    LUA_METRICS_SERVICE,
    LUA_MODELS_SERVICE,
    LUA_UNSERVED_BODY_FETCH,
    LUA_UNSERVED_REASON_FETCH,
    MODELS_MAP,
    SLOT_BACKEND_PREFIX,
    SLOTS_MAP,
    TENANT_REFUSAL_TABLE,
    TENANT_TABLE,
    TOKENS_TABLE,
    VAR_ASKED_CLASS,
    VAR_CLASS,
    VAR_CLOCK,
    VAR_OFFSET,
    VAR_SLOT,
    VAR_TAG,
    VAR_TENANT,
    PlatformHAProxySettings,
)

COST_MS = 12
AHEAD_MS = 60_000
MAX_OFFSET_MS = 524_000
# `owned_by` of each entry of the models list (as a stack's frontend answers it: infra.haproxy.models).
MODEL_OWNER = "sluice"
# The Lua source with `$placeholders` for every constant (string.Template).
LUA_TEMPLATE = Template(Path(__file__).with_name("platform_admission.lua.tmpl").read_text())
QUEUE_TIMEOUT_MESSAGE = "the model stayed at capacity for the whole admission wait: retry later"
UNREACHABLE_MESSAGE = "the team frontend of the model did not answer"


def _lua(value: str | float | list[str] | dict[str, str]) -> str:
    """A Lua literal of a string (printable ASCII only), a number, a list of strings or a table of strings."""
    if isinstance(value, list):
        return "{" + ", ".join(_lua(item) for item in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_lua(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        if not (value.isascii() and value.isprintable()):
            raise ValueError(f"refusing a non-printable or non-ASCII value in the Lua: {value!r}")
        return json.dumps(value)  # printable ASCII: escapes only quote and backslash, as Lua reads them
    return repr(value)


def _tenants(settings: PlatformHAProxySettings) -> str:
    entries = [
        f"    [{_lua(t.name)}] = {{ceiling = {t.priority_class}, weight = {t.weight!r},"
        f" counted = {'true' if t.tokens_per_minute is not None else 'false'}}},"
        for t in settings.tenants
    ]
    return "{\n" + "\n".join(entries) + "\n}"


def _unserved() -> str:
    """The reason and body of HAProxy's own 503 in a slot backend, by what happened."""
    cases = {
        REASON_QUEUE_TIMEOUT: (REASON_QUEUE_TIMEOUT, QUEUE_TIMEOUT_MESSAGE, 429),
        "unreachable": (REASON_MODEL_UNAVAILABLE, UNREACHABLE_MESSAGE, 503),
    }
    entries = [
        f"    [{_lua(case)}] = "
        + _lua({"reason": reason, "body": openai_error_body(f"sluice refused the request: {message}", status)})
        + ","
        for case, (reason, message, status) in cases.items()
    ]
    return "{\n" + "\n".join(entries) + "\n}"


def render_platform_lua(settings: PlatformHAProxySettings) -> str:
    """The admission actions, the models list, the unserved fetches and the counters, every constant rendered in."""
    return LUA_TEMPLATE.substitute(
        priority_classes=_lua(list(PRIORITY_CLASSES)),
        tenants=_tenants(settings),
        tenant_names=_lua([tenant.name for tenant in settings.tenants]),
        slots=str(settings.model_slots),
        slot_backend_prefix=_lua(SLOT_BACKEND_PREFIX),
        cost_ms=_lua(COST_MS),
        ahead_ms=_lua(AHEAD_MS),
        max_offset_ms=_lua(MAX_OFFSET_MS),
        var_tenant=_lua(VAR_TENANT),
        var_asked_class=_lua(VAR_ASKED_CLASS),
        var_slot=_lua(VAR_SLOT),
        var_class=_lua(VAR_CLASS),
        var_offset=_lua(VAR_OFFSET),
        var_tag=_lua(VAR_TAG),
        var_clock=_lua(VAR_CLOCK),
        models_map=_lua(str(settings.map_path(MODELS_MAP))),
        slots_map=_lua(str(settings.map_path(SLOTS_MAP))),
        access_map=_lua(str(settings.map_path(ACCESS_MAP))),
        access_separator=_lua(ACCESS_SEPARATOR),
        model_owner=_lua(MODEL_OWNER),
        tenant_table=_lua(TENANT_TABLE),
        tenant_refusal_table=_lua(TENANT_REFUSAL_TABLE),
        tokens_table=_lua(TOKENS_TABLE),
        timed_out_reason=_lua(REASON_QUEUE_TIMEOUT),
        unserved=_unserved(),
        admit_action=_lua(LUA_ADMIT_ACTION),
        admitted_action=_lua(LUA_ADMITTED_ACTION),
        models_service=_lua(LUA_MODELS_SERVICE),
        metrics_service=_lua(LUA_METRICS_SERVICE),
        unserved_reason_fetch=_lua(LUA_UNSERVED_REASON_FETCH),
        unserved_body_fetch=_lua(LUA_UNSERVED_BODY_FETCH),
    )
