"""Every error answer sluice makes itself has the OpenAI shape vLLM's own errors have: vLLM's `ErrorResponse`
validates it field for field (the frontend's rendered refusals, a replica middleware's, the internal credential's)."""

from __future__ import annotations

import asyncio
import json

import pytest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from infra.haproxy.formatting import openai_error_body
from services.internal_credential import InternalCredentialMiddleware
from services.replica.asgi_call import send_openai_error
from tests.support.frontend_contract import OPENAI_ERROR_FIELDS


def _vllm_shaped(body: bytes | str, status: int) -> ErrorInfo:
    error = ErrorResponse.model_validate_json(body).error
    assert set(json.loads(body)["error"]) == set(ErrorInfo.model_fields) == OPENAI_ERROR_FIELDS
    assert error.code == status and error.type and error.param is None
    return error


@pytest.mark.parametrize("status", [400, 401, 404, 413, 429, 503, 504])
def test_the_frontends_refusals_are_vllms_error_shape(status: int) -> None:
    assert _vllm_shaped(openai_error_body("sluice refused the request: too large", status), status).message.startswith(
        "sluice"
    )


def _answers(app, scope: dict) -> list[dict]:  # type: ignore[no-untyped-def]
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_a_replica_middlewares_refusal_and_the_internal_credentials_are_vllms_error_shape() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(send_openai_error(send, 503, "prefill_failed", "sluice: the prefill replica failed"))
    _vllm_shaped(sent[-1]["body"], 503)
    guarded = InternalCredentialMiddleware(lambda *_: None, "secret")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    answer = _answers(guarded, scope)
    assert answer[0]["status"] == 403
    _vllm_shaped(answer[-1]["body"], 403)
