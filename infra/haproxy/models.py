"""Several models behind one frontend: how HAProxy tells a request's model and answers what it cannot route.

The `x-sluice-model` header, else the body's top-level `model` within the first `model_lookup_bytes`, picks the app
(the Lua action, `infra/haproxy/sluice_route.lua.tmpl`); what it cannot tell gets 404 `model_not_found` or 400
`model_missing` / `model_beyond_buffer`. Details: infra/haproxy/README.md (several models).
"""

from __future__ import annotations

import json
import re
import time

from base.contracts import MODEL_HEADER, MODEL_REASONS, MODELS_PATH, SERVE_REASON_HEADER
from infra.haproxy.formatting import openai_error_body

# A served model name as OpenAI clients send it (e.g. "meta-llama/Llama-3.1-8B-Instruct"): nothing that needs
# escaping in JSON, a header, or a Lua string.
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}$")
VAR_MODEL = "txn.sluice_model"
# The refusal's message, JSON-escaped by the Lua action (it may quote the client's model name).
VAR_ERROR = "txn.sluice_error"
# The JSON path of the model in an OpenAI request body (`json_query`: top level only).
MODEL_JSON_PATH = "$.model"


def capture_model_header_line() -> str:
    """Keep the client's model header before the internal headers are stripped."""
    return f"    http-request set-var({VAR_MODEL}) req.hdr({MODEL_HEADER}) if {{ req.hdr({MODEL_HEADER}) -m found }}"


def models_list_body(models: list[str], created: int | None = None) -> str:
    """`GET /v1/models` as OpenAI (and vLLM) answer it, for every model of the frontend."""
    created = int(time.time()) if created is None else created
    data = [{"id": name, "object": "model", "created": created, "owned_by": "sluice"} for name in models]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":"))


def models_list_line(models: list[str]) -> str:
    body = models_list_body(models)
    if "'" in body:
        raise ValueError("a model name may not hold a quote")
    return (
        f"    http-request return status 200 content-type application/json string '{body}'"
        f" if {{ method GET HEAD }} {{ path {MODELS_PATH} }}"
    )


def model_refusal_lines(reason_var: str, refusal_table: str) -> list[str]:
    """Count, then answer, each model refusal the Lua action decided (`reason_var` holds its reason)."""
    lines = []
    for reason, status in MODEL_REASONS.items():
        condition = f"{{ var({reason_var}) -m str {reason} }}"
        body = openai_error_body(f"%[var({VAR_ERROR})]", status)
        lines += [
            f"    http-request track-sc2 str({reason}) table {refusal_table} if {condition}",
            f"    http-request return status {status} content-type application/json"
            f" hdr {SERVE_REASON_HEADER} {reason} lf-string '{body}' if {condition}",
        ]
    return lines
