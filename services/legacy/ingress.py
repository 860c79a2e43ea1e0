"""The retained legacy ingress: the old path, kept deployed beside direct streaming so traffic can move back.

client -> Serve's proxy (or the frontend's legacy backend) -> `LegacyIngress`, a Python Serve replica -> a streaming
DeploymentHandle call to the LLM deployment's `stream()`, which runs the replica's own app in-process. Routing,
capacity tokens and disconnects on this path: services/legacy/README.md.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.deployment import Application
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount

from base.contracts import (
    CHOSEN_REPLICA_HEADER,
    LEGACY_PATH,
    PREFILL_BY_CALLER_HEADER,
    PREFILL_REPLICA_HEADER,
    PREFILL_URL_HEADER,
    REASON_REPLICA_FAILED,
    SERVE_PATH_HEADER,
    NodeRole,
    node_role_resources,
)
from base.rollout import config_version
from services.internal_credential import InternalCredentialMiddleware, internal_credential
from services.legacy.handle_path import chosen_stream, prefill_choice
from services.replica.asgi_call import ResponseStart, read_body, route_path, send_openai_error
from services.replica.llm_config import LLM_DEPLOYMENT_NAME
from services.replica.middleware.replica_headers import Receive, Scope, Send
from services.serve_internals import list_replica_endpoints, with_rollout_version

LEGACY_DEPLOYMENT_NAME = "LegacyIngress"
_PATH_STAMP = (SERVE_PATH_HEADER.encode(), LEGACY_PATH.encode())
_CHOSEN = CHOSEN_REPLICA_HEADER.encode()
# Headers of the client's request that belong to its connection, not to the request the replica runs.
_HOP_BY_HOP = frozenset({"host", "connection", "content-length", "transfer-encoding", "keep-alive", "upgrade"})
# What names a decode replica's prefill: set by the relay alone, never the client's.
_PREFILL_HEADERS = frozenset({PREFILL_REPLICA_HEADER, PREFILL_URL_HEADER, PREFILL_BY_CALLER_HEADER})


# A relayed request: method, path (with its query), body, headers.
Call = tuple[str, str, bytes, dict[str, str]]


class LegacyIngressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_app: str = Field(min_length=1)
    target_deployment: str = LLM_DEPLOYMENT_NAME
    # A prefill/decode model's prefill app: the relay chooses a prefill replica for each request there.
    prefill_app: str | None = None
    num_replicas: int = Field(1, ge=1)
    # Concurrent streams one ingress replica relays (each holds a handle call open).
    max_ongoing_requests: int = Field(256, ge=1)
    # A stack across nodes runs its ingress on the head node; None: one machine.
    node_role: NodeRole | None = None


def forwarded_headers(scope: Scope) -> dict[str, str]:
    """The client's headers for the replica (lower-case names; a repeated header keeps its last value)."""
    return {
        k.decode("latin-1").lower(): v.decode("latin-1")
        for k, v in scope["headers"]
        if k.decode("latin-1").lower() not in _HOP_BY_HOP
    }


class PrefillSide:
    """A prefill/decode model's prefill deployment: its handle, and where each of its replicas serves HTTP (its own
    port under the app's prefix), found as sluice finds every replica's port and looked up again for a replica it
    has not seen (Serve's selection names the replica's internal gRPC port, not its HTTP one)."""

    def __init__(self, handle: Any, app: str) -> None:
        self.handle = handle
        self._app = app
        self._urls: dict[str, str] = {}

    async def url_of(self, replica_id: str) -> str | None:
        if replica_id not in self._urls:
            self._urls = {e.replica_id: f"{e.url}/{self._app}" for e in await list_replica_endpoints(self._app)}
        return self._urls.get(replica_id)


async def _with_prefill(prefill: PrefillSide, call: Call, held: AsyncExitStack) -> Call:
    """`call` naming the prefill replica chosen for it (the client's own prefill headers dropped), the choice held on
    `held`."""
    method, path, body, headers = call
    call = (method, path, body, {k: v for k, v in headers.items() if k not in _PREFILL_HEADERS})
    chosen = await held.enter_async_context(prefill_choice(prefill.handle, prefill.url_of, *call))
    return (method, path, body, call[3] | chosen)


class HandleRelay:
    """ASGI app relaying each HTTP request through a streaming DeploymentHandle call to `stream()`, on the replica
    the deployment's request router chose (`chosen_stream`), stamped with that choice. `stream` is the LLM
    deployment's handle to its `stream()` method, streaming. With `prefill` (the decode side of prefill/decode),
    each request first gets a prefill replica (`prefill_choice`), held until the decode replica answers: its
    response starts once the prefill is done."""

    def __init__(self, stream: Any, prefill: PrefillSide | None = None) -> None:
        self._stream = stream
        self._prefill = prefill

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        query = scope.get("query_string", b"").decode("latin-1")
        path = route_path(scope) + (f"?{query}" if query else "")
        call = (scope["method"], path, body, forwarded_headers(scope))
        disconnect = asyncio.ensure_future(receive())
        relay = asyncio.ensure_future(self._relay(call, send))
        try:
            await asyncio.wait({disconnect, relay}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                relay.result()
        finally:
            for task in (relay, disconnect):
                task.cancel()
            # A client gone: the relay's cancellation cancels the call and leaves the replica's choice.
            await asyncio.gather(relay, return_exceptions=True)

    async def _relay(self, call: Call, send: Send) -> None:
        started = False
        try:
            async with AsyncExitStack() as prefill_held:
                if self._prefill is not None:
                    call = await _with_prefill(self._prefill, call, prefill_held)
                async with chosen_stream(self._stream, *call) as chosen:
                    stamps = [_PATH_STAMP, (_CHOSEN, chosen.replica_id.encode("latin-1"))]
                    async for item in chosen.items:
                        if isinstance(item, ResponseStart):
                            await prefill_held.aclose()
                            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in item.headers] + stamps
                            await send({"type": "http.response.start", "status": item.status, "headers": headers})
                            started = True
                        elif started:
                            await send({"type": "http.response.body", "body": item, "more_body": True})
        except Exception as error:  # the replica died or refused the call: an answer if none has started
            if started:
                raise
            message = f"the legacy path could not reach a replica: {type(error).__name__}"
            await send_openai_error(
                send, 502, REASON_REPLICA_FAILED, message, [(SERVE_PATH_HEADER.encode(), LEGACY_PATH)]
            )
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@serve.ingress()
class LegacyIngress:
    def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = LegacyIngressSettings.model_validate(settings)
        handle = serve.get_deployment_handle(self._settings.target_deployment, app_name=self._settings.target_app)
        prefill = None
        if self._settings.prefill_app is not None:
            prefill_handle = serve.get_deployment_handle(LLM_DEPLOYMENT_NAME, app_name=self._settings.prefill_app)
            prefill = PrefillSide(prefill_handle.options(stream=True).stream, self._settings.prefill_app)
        relay = HandleRelay(handle.options(stream=True).stream, prefill)
        # Only what came through the frontend (HAProxy adds the credential) reaches the relay.
        credential = Middleware(InternalCredentialMiddleware, credential=internal_credential())
        self._app = Starlette(routes=[Mount("/", app=relay)], middleware=[credential])

    async def __serve_build_asgi_app__(self) -> Starlette:
        return self._app


def legacy_ingress_application(settings: LegacyIngressSettings) -> Application:
    """The legacy ingress app in front of `settings.target_app`'s LLM deployment."""
    deployment = serve.deployment(LegacyIngress).options(
        name=LEGACY_DEPLOYMENT_NAME,
        num_replicas=settings.num_replicas,
        max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, "resources": node_role_resources(settings.node_role)},
    )
    version = config_version([settings.model_dump(mode="json"), LEGACY_DEPLOYMENT_NAME])
    return with_rollout_version(deployment, version).bind(settings.model_dump())


def build_legacy_ingress_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.legacy.ingress:build_legacy_ingress_application`)."""
    return legacy_ingress_application(LegacyIngressSettings.model_validate(args))
