"""The zero-compute engine stand-in behind vLLM's own OpenAI app, on one real vLLM engine (the tiny model) started
in-process for the module: chat and completions, streamed and not, come out well-formed (role chunk first, one
token per chunk, `length` finish, usage with the right counts, `[DONE]` last), with `max_tokens` copies of the
stand-in's token, and the real engine generates nothing for them (its own metrics say so)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing.resource_tracker
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from transformers import AutoTokenizer
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from base.contracts import ENGINE_STAND_IN_HEADER, ZERO_COMPUTE_STAND_IN
from base.tiny_model import SERVED_MODEL_NAME
from base.waiting import wait_until
from services.replica.asgi_call import ResponseStart, stream_asgi
from services.replica.llm_config import EngineConfig
from services.replica.middleware.replica_headers import ASGIApp, ReplicaHeadersMiddleware
from services.replica.vllm_app import build_openai_app, parse_engine_args, start_engine
from services.replica.zero_compute_engine import ZeroComputeEngineStandIn
from tests.support.sse import chunks, data_payloads

pytestmark = [pytest.mark.integration, pytest.mark.engine]

MAX_TOKENS = 9
MESSAGES = [{"role": "user", "content": "route the stream"}]
PROMPT = "ka lo mi"
# " token" in the tiny model's tokenizer: one ordinary word piece.
TINY_STAND_IN_TOKEN = 310
STREAMED_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
_ENGINE_COUNTERS = re.compile(r"^vllm:(generation_tokens_total|request_success_total)\{[^}]*\} (\S+)$", re.M)


@dataclass
class Served:
    runner: asyncio.Runner
    engine: AsyncLLM
    stand_in: ZeroComputeEngineStandIn
    app: ASGIApp
    tokenizer: Any

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[ResponseStart, list[bytes]]:
        """The response start and each body chunk as the app sent it."""

        async def collect() -> list[ResponseStart | bytes]:
            raw = json.dumps(body).encode() if body is not None else b""
            return [
                item async for item in stream_asgi(self.app, method, path, raw, {"content-type": "application/json"})
            ]

        start, *parts = self.runner.run(asyncio.wait_for(collect(), 60))
        assert isinstance(start, ResponseStart)
        return start, [bytes(part) for part in parts]

    def engine_counters(self) -> dict[str, float]:
        """The real engine's generated tokens and finished requests, from vLLM's /metrics."""
        start, parts = self.call("GET", "/metrics")
        assert start.status == 200
        totals = {"generation_tokens_total": 0.0, "request_success_total": 0.0}
        for name, value in _ENGINE_COUNTERS.findall(b"".join(parts).decode()):
            totals[name] += float(value)
        return totals


def _end_engine_processes(before: set[int], grace_s: float = 15.0) -> None:
    """The processes vLLM started for the engine (its engine core, which vLLM force-kills and leaves unreaped when it
    ignores SIGTERM, and the multiprocessing resource tracker its spawn started): ended and reaped."""
    tracker = multiprocessing.resource_tracker._resource_tracker
    if tracker._pid is not None and tracker._pid not in before:
        tracker._stop()  # the stdlib's own way to end it: close its pipe, then reap it
    started = [p for p in psutil.Process().children() if p.pid not in before]
    started += [c for p in started for c in p.children(recursive=True)]
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for process in alive:
        process.kill()
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    assert not left, f"engine processes left behind: {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    before = {p.pid for p in psutil.Process().children()}
    runner = asyncio.Runner()
    args = parse_engine_args(EngineConfig(model=str(tiny_model_dir)))
    engine = start_engine(args)
    try:
        stand_in = ZeroComputeEngineStandIn(engine)
        app = runner.run(build_openai_app(stand_in, args))  # type: ignore[arg-type]
        # As the replica does: the stand-in's name on every response.
        stamped = ReplicaHeadersMiddleware(app, "replica-0", echo_request_id=True, engine_stand_in=stand_in.name)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        yield Served(runner, engine, stand_in, stamped, tokenizer)
    finally:
        engine.shutdown()
        runner.close()
        _end_engine_processes(before)


def _body(**fields: Any) -> dict[str, Any]:
    """A request for `MAX_TOKENS` tokens of the tiny model, with `fields`."""
    return {"model": SERVED_MODEL_NAME, "max_tokens": MAX_TOKENS, **fields}


def _sse_events(start: ResponseStart, parts: list[bytes]) -> list[dict[str, Any]]:
    """The stream's JSON events, checking that it is SSE, `[DONE]` comes last, and every chunk on the wire holds
    exactly one event."""
    assert start.status == 200, parts
    assert (start.header("content-type") or "").startswith("text/event-stream")
    for part in parts:
        assert data_payloads(part.decode()) and part.count(b"data: ") == 1, part
    return chunks(data_payloads(b"".join(parts).decode()))


def test_the_stand_in_token_is_an_ordinary_word_of_the_tiny_model(served: Served) -> None:
    assert served.stand_in.token_id == TINY_STAND_IN_TOKEN
    assert served.stand_in.token_text == served.tokenizer.decode([TINY_STAND_IN_TOKEN]) == " token"


def test_a_streamed_chat_with_usage_is_well_formed_with_one_token_per_chunk(served: Served) -> None:
    start, parts = served.call("POST", "/v1/chat/completions", _body(messages=MESSAGES, **STREAMED_WITH_USAGE))
    assert start.header(ENGINE_STAND_IN_HEADER) == ZERO_COMPUTE_STAND_IN
    events = _sse_events(start, parts)
    first, *tokens, usage_event = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"]["content"] for e in tokens] == [" token"] * MAX_TOKENS
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * (MAX_TOKENS - 1) + ["length"]
    rendered = served.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(served.tokenizer.encode(rendered, add_special_tokens=False))
    assert usage_event["choices"] == []
    assert usage_event["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": MAX_TOKENS,
        "total_tokens": prompt_tokens + MAX_TOKENS,
    }
    assert len({e["id"] for e in events}) == 1


def test_a_streamed_completion_with_usage_is_well_formed(served: Served) -> None:
    start, parts = served.call("POST", "/v1/completions", _body(prompt=PROMPT, **STREAMED_WITH_USAGE))
    *tokens, usage_event = _sse_events(start, parts)
    assert [e["choices"][0]["text"] for e in tokens] == [" token"] * MAX_TOKENS
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_event["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_non_streamed_completion_answers_max_tokens_of_the_stand_in_token(served: Served) -> None:
    start, parts = served.call("POST", "/v1/completions", _body(prompt=PROMPT))
    assert start.status == 200 and start.header(ENGINE_STAND_IN_HEADER) == ZERO_COMPUTE_STAND_IN
    answer = json.loads(b"".join(parts))
    (choice,) = answer["choices"]
    assert choice["text"] == served.tokenizer.decode([TINY_STAND_IN_TOKEN] * MAX_TOKENS)
    assert choice["finish_reason"] == "length"
    prompt_tokens = len(served.tokenizer.encode(PROMPT))
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert answer["usage"]["total_tokens"] == prompt_tokens + MAX_TOKENS


def test_a_non_streamed_chat_answers_max_tokens_of_the_stand_in_token(served: Served) -> None:
    start, parts = served.call("POST", "/v1/chat/completions", _body(messages=MESSAGES))
    assert start.status == 200
    answer = json.loads(b"".join(parts))
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == " token" * MAX_TOKENS
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_what_the_stand_in_cannot_fake_is_an_openai_400(served: Served) -> None:
    start, parts = served.call("POST", "/v1/completions", _body(prompt=PROMPT, n=2))
    assert start.status == 400
    assert json.loads(b"".join(parts))["error"]["param"] == "n"


def test_the_real_engine_generates_nothing_for_the_stand_ins_answers(served: Served) -> None:
    before = served.engine_counters()
    for stream in (True, False):
        assert served.call("POST", "/v1/chat/completions", _body(messages=MESSAGES, stream=stream))[0].status == 200
    assert served.engine_counters() == before

    async def generate_for_real() -> None:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        async for _ in served.engine.generate({"prompt": PROMPT}, params, "real-engine-control"):
            pass

    # The control: the same counters do move when the real engine generates.
    served.runner.run(generate_for_real())
    wait_until(
        5,
        lambda: served.engine_counters()["generation_tokens_total"] >= before["generation_tokens_total"] + 2,
        "the real engine's counters to move (else the check above proves nothing)",
        poll_s=0.05,
    )
