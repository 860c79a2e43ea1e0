"""`sluice check`'s API contract item: vLLM's OpenAI contract as a client sees it through the frontend.

The same greedy chat request streamed and not: the same text, finish_reason and usage. The stream's order: the
assistant's role in the first chunk, the finish_reason on the last chunk with a choice, usage alone in the last chunk,
then `[DONE]`. A forced tool call, streamed, where the model has tool calling (vLLM refuses a named tool choice
without a tool-call parser): its argument fragments join into JSON that fits the tool's schema.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema

from base import sse
from sluice.deploy.check.items import WEATHER_SCHEMA, Result, chat, forced_tool_call, headers

USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


class ContractBroken(Exception):
    """What a response does not keep of the contract."""


def _streamed(client: httpx.Client, base: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's chunks, in order, once it ended with `[DONE]`."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post(f"{base}/v1/chat/completions", json=body, headers=headers())
    if response.status_code != 200:
        raise ContractBroken(f"a streamed chat completion got {response.status_code}")
    events = sse.data_payloads(sse.lines(response.content))
    if not events or events[-1] != sse.DONE:
        raise ContractBroken("the stream does not end with [DONE]")
    return [json.loads(event) for event in events[:-1]]


def stream_outcome(chunks: list[dict[str, Any]]) -> tuple[str, str, dict[str, int]]:
    """The streamed text, finish_reason and usage, after checking the chunks' order."""
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    if not with_choices or with_choices[0]["choices"][0]["delta"].get("role") != "assistant":
        raise ContractBroken("the first chunk does not carry the assistant role")
    finish = with_choices[-1]["choices"][0].get("finish_reason")
    if not finish or any(chunk["choices"][0].get("finish_reason") for chunk in with_choices[:-1]):
        raise ContractBroken("the finish_reason is not on the last chunk with a choice, alone")
    if chunks[-1]["choices"] or not chunks[-1].get("usage") or any(chunk.get("usage") for chunk in chunks[:-1]):
        raise ContractBroken("usage is not alone in the last chunk before [DONE]")
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in with_choices)
    return text, finish, {field: chunks[-1]["usage"][field] for field in USAGE_FIELDS}


def whole_outcome(client: httpx.Client, base: str, body: dict[str, Any]) -> tuple[str, str, dict[str, int]]:
    response = client.post(f"{base}/v1/chat/completions", json=body, headers=headers())
    if response.status_code != 200:
        raise ContractBroken(f"a chat completion got {response.status_code}")
    answer = response.json()
    choice = answer["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], {f: answer["usage"][f] for f in USAGE_FIELDS}


def streamed_tool_arguments(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The forced tool call's arguments, joined from the stream's fragments and parsed."""
    fragments = [
        call.get("function", {}).get("arguments") or ""
        for chunk in chunks
        if chunk["choices"]
        for call in chunk["choices"][0]["delta"].get("tool_calls") or []
    ]
    try:
        return json.loads("".join(fragments))
    except ValueError as error:
        raise ContractBroken(f"the streamed tool call's arguments are not JSON ({error})") from None


def api_contract(client: httpx.Client, base: str, model: str, tool_calls: bool = True) -> Result:
    """`tool_calls`: whether the model has tool calling (its spec's `engine.tool_call_parser`)."""
    try:
        body = chat(model)
        streamed = stream_outcome(_streamed(client, base, body))
        whole = whole_outcome(client, base, body)
        if streamed != whole:
            return False, f"streamed {streamed} but not streamed {whole} (text, finish_reason, usage)"
        arguments = streamed_tool_arguments(_streamed(client, base, forced_tool_call(model))) if tool_calls else None
        if arguments is not None:
            jsonschema.validate(arguments, WEATHER_SCHEMA)
    except ContractBroken as broken:
        return False, str(broken)
    except jsonschema.ValidationError as error:
        return False, f"the streamed tool call's arguments miss the tool's schema: {error.message}"
    text, finish, usage = streamed
    tools = f"streamed forced tool call {arguments}" if tool_calls else "no tool call: the spec asks no tool calling"
    return True, (
        f"streamed = not streamed ({len(text)} chars, finish_reason {finish}, usage {usage}); role first, usage last, "
        f"[DONE]; {tools}"
    )
