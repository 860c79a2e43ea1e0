"""How values are written in the rendered HAProxy config: times, the body of every error the frontend answers
itself (`base.openai_error`: the OpenAI error shape vLLM's errors have, so a client's OpenAI SDK parses it;
infra/haproxy/README.md), and the stick tables that count requests by a reason for sluice's frontend counters.
"""

from __future__ import annotations

import json

from base.openai_error import openai_error


def openai_error_body(message: str, status: int) -> str:
    """`base.openai_error`'s body for `status` as JSON text; `message` may hold HAProxy log-format expressions but no
    quote of either kind (the body is rendered inside single quotes)."""
    if "'" in message or '"' in message:
        raise ValueError(f"an error message may not hold quotes: {message!r}")
    return json.dumps(openai_error(message, status))


def haproxy_time(seconds: float) -> str:
    """An HAProxy time: whole seconds as `Ns`, anything finer in milliseconds."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def counter_table_lines(
    name: str, comment: str, keys: int, key_bytes: int = 32, store: str = "http_req_cnt"
) -> list[str]:
    """A backend holding only a stick table that counts requests by a string key, with room for `keys` of them
    (four times over: a key is never evicted while the few real ones fit)."""
    return [
        f"backend {name}",
        f"    # {comment}",
        f"    stick-table type string len {key_bytes} size {keys * 4} store {store}",
        "",
    ]
