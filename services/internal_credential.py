"""The cluster's internal credential: HAProxy adds it to every request it forwards, and the ports past the frontend
(LLM replicas, routers, the legacy ingress) refuse a request without it, so a client that reaches one of those ports
directly (Serve binds them on the node's address) gets 403 instead of an engine, a route or a capacity token.

One secret per Ray cluster, in Ray's internal KV: the first process that asks creates it (a put that never
overwrites, so two first askers agree on whichever landed), every later one reads it. 32 random bytes, URL-safe
base64: it goes into HAProxy's configuration and Lua as a plain token. A client cannot send it through the frontend:
HAProxy strips every `x-sluice-` header from clients before it sets its own (base.contracts.INTERNAL_HEADER_PREFIXES).

Exempt, because they are probes, not requests: Serve's health path and `GET .../metrics` (Prometheus scrapes each
replica and router where the frontend's target discovery lists them). Anything else without the credential is
answered 403 with an OpenAI-style body and `X-Serve-Reason: internal_credential`. The comparison takes constant time.
"""

from __future__ import annotations

import hmac
import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from base.contracts import HEALTH_PATH, INTERNAL_CREDENTIAL_HEADER, REASON_INTERNAL_CREDENTIAL, SERVE_REASON_HEADER
from base.openai_error import openai_error

CREDENTIAL_KEY = b"sluice-internal-credential"
CREDENTIAL_BYTES = 32
METRICS_SUFFIX = "/metrics"
_HEADER = INTERNAL_CREDENTIAL_HEADER.encode()


# The credential of each cluster this process has asked (by its GCS address): it never changes while the cluster runs.
_known: dict[str, str] = {}


def internal_credential() -> str:
    """The cluster's credential, created on first use; needs a connected Ray (a driver or any Ray worker)."""
    import ray
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError("the internal credential lives in Ray's KV: connect to the cluster first")
    cluster = ray.get_runtime_context().gcs_address
    if cluster not in _known:
        fresh = secrets.token_urlsafe(CREDENTIAL_BYTES).encode()
        internal_kv._internal_kv_put(CREDENTIAL_KEY, fresh, overwrite=False)
        stored = internal_kv._internal_kv_get(CREDENTIAL_KEY)
        if stored is None:
            raise RuntimeError("Ray's KV lost the internal credential it just kept")
        _known[cluster] = stored.decode()
    return _known[cluster]


def internal_headers() -> dict[str, str]:
    """What a caller inside the cluster (a frontend, a router, the CLI, a test) sends to a port past the frontend."""
    return {INTERNAL_CREDENTIAL_HEADER: internal_credential()}


def is_probe(method: str, path: str) -> bool:
    """A health probe or a metrics scrape: answered without the credential."""
    return path.endswith(HEALTH_PATH) or (method in ("GET", "HEAD") and path.endswith(METRICS_SUFFIX))


class InternalCredentialMiddleware:
    """Refuse (403) an HTTP request that carries neither the credential nor is a probe; pass everything else on."""

    def __init__(self, app: ASGIApp, credential: str) -> None:
        self.app = app
        self.credential = credential.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_probe(scope["method"], scope["path"]) or self._carries(scope):
            await self.app(scope, receive, send)
            return
        message = "this port serves the stack's frontend only: send the request to the frontend"
        body = json.dumps(openai_error(message, 403)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (SERVE_REASON_HEADER.encode(), REASON_INTERNAL_CREDENTIAL.encode()),
        ]
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _carries(self, scope: Scope) -> bool:
        sent = [value for name, value in scope["headers"] if name == _HEADER]
        return len(sent) == 1 and hmac.compare_digest(sent[0], self.credential)
