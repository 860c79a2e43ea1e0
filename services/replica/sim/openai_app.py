"""The simulator's HTTP face: the shape of vLLM's OpenAI app over one `SimEngine` (a benchmark stand-in).

What a router, HAProxy and a load client see of a vLLM replica, and nothing they do not: `POST /v1/chat/completions`
and `/v1/completions` (streamed as vLLM streams them: a role chunk, a chunk per token, the finish, then `usage` with
`prompt_tokens_details.cached_tokens` when `stream_options.include_usage` asks; or one JSON answer), `GET /v1/models`,
vLLM's `vllm:` gauges and counters at `/metrics` (running, waiting, KV usage, prefix cache queries and hits, prompt
and generation tokens), where it publishes KV events (`KV_EVENTS_PATH`), its engine load (`ENGINE_LOAD_PATH`) and
Serve's health path. The prompt is rendered and tokenized as vLLM would (`routers.prompt_tokens.PromptTokens`, the
served model's template and tokenizer), so its blocks are the blocks a router computes. Every response says it came
from the stand-in (`x-serve-engine-stand-in: sim`) and which replica served (`x-serve-replica`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from base.contracts import (
    ENGINE_LOAD_PATH,
    ENGINE_STAND_IN_HEADER,
    HEALTH_PATH,
    KV_EVENTS_PATH,
    REPLICA_HEADER,
    SIM_STAND_IN,
)
from base.route_wire import EngineLoad, EngineLoads, KVEventSource, KVEventSources
from routers.prompt_tokens import PromptTokens
from services.replica.sim.engine import SimEngine

# The words the simulated engines answer with, one token each in a byte-level BPE: re-sent as the next turn's
# history, they tokenize back into the very tokens generated, so a conversation's answer blocks can hit.
ANSWER_WORDS = (" token",)
# A request that names no `max_tokens` gets this many (vLLM's default is the rest of the context: far too long for a
# simulated campaign).
DEFAULT_MAX_TOKENS = 16


def answer_tokens(tokens: PromptTokens) -> dict[int, str]:
    """The answer words' token ids and their text, in the served model's tokenizer."""
    ids = [tokens.text_tokens(word) for word in ANSWER_WORDS]
    if any(len(word) != 1 for word in ids):
        raise ValueError(f"the answer words {ANSWER_WORDS} are not one token each in {tokens.model_path}")
    return {word[0]: tokens.decode(word) for word in ids}


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


class SimOpenAIApp:
    """Routes of one simulated replica; `app` is its Starlette app."""

    def __init__(
        self,
        engine: SimEngine,
        tokens: PromptTokens,
        served_name: str,
        replica_id: str,
        kv_source: KVEventSource | None,
        token_text: Mapping[int, str],
    ) -> None:
        """`token_text`: the text of each token the engine generates (its `output_token_ids`)."""
        self.engine = engine
        self.tokens = tokens
        self.served_name = served_name
        self.replica_id = replica_id
        self.kv_source = kv_source
        self._headers = {ENGINE_STAND_IN_HEADER: SIM_STAND_IN, REPLICA_HEADER: replica_id}
        self.token_text = token_text
        self.app = FastAPI(
            openapi_url=None,
            docs_url=None,
            redoc_url=None,
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route(KV_EVENTS_PATH, self.kv_events, methods=["GET"]),
                Route(ENGINE_LOAD_PATH, self.engine_load, methods=["GET"]),
                Route(HEALTH_PATH, self.health, methods=["GET"]),
            ],
        )

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completion(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        if body.get("model") != self.served_name:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if chat != ("messages" in body):
            return _error(400, "a chat request needs `messages`, a completion `prompt`")
        prompt = self.tokens(raw)
        if not prompt:
            return _error(400, "no prompt this simulator can render (text prompts and text messages only)")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        outputs = self.engine.generate(request_id, prompt, max_tokens)
        try:
            first = await anext(outputs)
        except ValueError as refused:
            return _error(400, str(refused))
        answer = _Answer(self, chat, request_id, len(prompt))
        stream_options = body.get("stream_options") or {}
        if body.get("stream"):
            chunks = answer.stream(first, outputs, bool(stream_options.get("include_usage")))
            return StreamingResponse(chunks, media_type="text/event-stream", headers=self._headers)
        return JSONResponse(await answer.whole(first, outputs), headers=self._headers)

    async def models(self, request: Request) -> Response:
        card = {"id": self.served_name, "object": "model", "created": 0, "owned_by": "sluice-sim"}
        return JSONResponse({"object": "list", "data": [card]}, headers=self._headers)

    async def metrics(self, request: Request) -> Response:
        engine, load = self.engine, self.engine.load()
        label = f'{{model_name="{self.served_name}"}}'
        figures = [
            ("vllm:num_requests_running", "gauge", load.running),
            ("vllm:num_requests_waiting", "gauge", load.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", load.kv_tokens_used / (load.num_blocks * load.block_size)),
            ("vllm:prefix_cache_queries_total", "counter", engine.cache.queries),
            ("vllm:prefix_cache_hits_total", "counter", engine.cache.hits),
            ("vllm:prompt_tokens_total", "counter", engine.prompt_tokens_total),
            ("vllm:generation_tokens_total", "counter", engine.generation_tokens_total),
            ("vllm:request_success_total", "counter", engine.requests_finished_total),
        ]
        lines = []
        for name, kind, value in figures:
            lines += [f"# TYPE {name} {kind}", f"{name}{label} {value}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def kv_events(self, request: Request) -> Response:
        sources = {0: self.kv_source} if self.kv_source is not None else {}
        announced = KVEventSources(block_size=self.engine.model.block_size, sources=sources)
        return JSONResponse(announced.model_dump(mode="json"))

    async def engine_load(self, request: Request) -> Response:
        load = self.engine.load()
        rank = EngineLoad(
            running=load.running,
            waiting=load.waiting,
            kv_tokens_used=load.kv_tokens_used,
            prefill_tokens_pending=load.prefill_tokens_pending,
            kv_tokens_total=load.num_blocks * load.block_size,
            prefix_cache_queries=self.engine.cache.queries,
            prefix_cache_hits=self.engine.cache.hits,
            request_seconds=self.engine.request_seconds.value,
        )
        return JSONResponse(EngineLoads(ranks={0: rank}).model_dump(mode="json"))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)


class _Answer:
    """One request's answer, streamed or whole, in vLLM's OpenAI shapes."""

    def __init__(self, app: SimOpenAIApp, chat: bool, request_id: str, prompt_tokens: int) -> None:
        self.app = app
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.app.served_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def stream(self, first: Any, rest: AsyncIterator[Any], include_usage: bool) -> AsyncIterator[bytes]:
        if self.chat:
            yield self._chunk([self._choice(None, None, role=True)])
        async for output in _chained(first, rest):
            self.cached_tokens = output.num_cached_tokens
            self.completion_tokens += len(output.token_ids)
            text = "".join(self.app.token_text[token] for token in output.token_ids)
            yield self._chunk([self._choice(text, "length" if output.finished else None)])
        if include_usage:
            yield self._chunk([], self.usage())
        yield b"data: [DONE]\n\n"

    async def whole(self, first: Any, rest: AsyncIterator[Any]) -> dict[str, Any]:
        texts = []
        async for output in _chained(first, rest):
            self.cached_tokens = output.num_cached_tokens
            self.completion_tokens += len(output.token_ids)
            texts.extend(self.app.token_text[token] for token in output.token_ids)
        text = "".join(texts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.app.served_name,
            "choices": [choice],
            "usage": self.usage(),
        }


async def _chained(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for output in rest:
        yield output
