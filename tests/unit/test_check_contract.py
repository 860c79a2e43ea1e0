"""The API contract item's reading of a stream: its order, its outcome, a streamed tool call's arguments."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from sluice.deploy.check.contract import ContractBroken, api_contract, stream_outcome, streamed_tool_arguments

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def _choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


def _stream() -> list[dict[str, Any]]:
    """vLLM's shape: the role, the text's pieces, the finish_reason on the last choice, usage alone at the end."""
    return [
        _choice({"role": "assistant", "content": ""}),
        _choice({"content": "ka"}),
        _choice({"content": " lo"}),
        _choice({"content": " mi"}, finish="length"),
        {"choices": [], "usage": {**USAGE, "prompt_tokens_details": None}},
    ]


def test_a_stream_in_order_gives_its_text_finish_reason_and_usage() -> None:
    assert stream_outcome(_stream()) == ("ka lo mi", "length", USAGE)


@pytest.mark.parametrize(
    ("breaking", "complaint"),
    [
        (lambda chunks: chunks.pop(0), "assistant role"),
        (lambda chunks: chunks[1]["choices"][0].update(finish_reason="stop"), "finish_reason"),
        (lambda chunks: chunks[3]["choices"][0].update(finish_reason=None), "finish_reason"),
        (lambda chunks: chunks.pop(), "usage"),
        (lambda chunks: chunks[2].update(usage=USAGE), "usage"),
        (lambda chunks: chunks.insert(3, chunks.pop()), "usage"),
    ],
)
def test_a_stream_out_of_order_is_named(breaking: Any, complaint: str) -> None:
    chunks = copy.deepcopy(_stream())
    breaking(chunks)
    with pytest.raises(ContractBroken, match=complaint):
        stream_outcome(chunks)


def test_a_streamed_tool_calls_fragments_join_into_its_arguments() -> None:
    call = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    chunks = [
        _choice({"role": "assistant", "tool_calls": [call]}),
        _choice({"tool_calls": [{"index": 0, "function": {"arguments": '{"unit": "c", '}}]}),
        _choice({"tool_calls": [{"index": 0, "function": {"arguments": '"days": 3, "alerts": false}'}}]}),
        _choice({}, finish="tool_calls"),
        {"choices": [], "usage": USAGE},
    ]
    assert streamed_tool_arguments(chunks) == {"unit": "c", "days": 3, "alerts": False}
    chunks.pop(2)
    with pytest.raises(ContractBroken, match="not JSON"):
        streamed_tool_arguments(chunks)


def _without_tool_calling(request: httpx.Request) -> httpx.Response:
    """A model served without a tool-call parser: vLLM answers chat, and refuses a named tool choice."""
    body = json.loads(request.content)
    if "tool_choice" in body:
        return httpx.Response(400, json={"error": {"message": "requires --tool-call-parser to be set"}})
    if body.get("stream"):
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in _stream()) + "data: [DONE]\n\n"
        return httpx.Response(200, content=events.encode())
    message = {"role": "assistant", "content": "ka lo mi"}
    return httpx.Response(200, json={"choices": [{"message": message, "finish_reason": "length"}], "usage": USAGE})


def test_the_contract_asks_a_forced_tool_call_only_of_a_model_with_tool_calling() -> None:
    with httpx.Client(transport=httpx.MockTransport(_without_tool_calling)) as client:
        ok, detail = api_contract(client, "http://stack", "m", tool_calls=False)
        assert ok is True and "no tool call: the spec asks no tool calling" in detail, detail
        ok, detail = api_contract(client, "http://stack", "m", tool_calls=True)
        assert ok is False and "got 400" in detail, detail
