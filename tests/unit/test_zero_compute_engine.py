"""The zero-compute engine stand-in emits what vLLM's output processor would, without any engine: a fake inner engine
gives it a tokenizer and a model config, nothing else."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from base.contracts import ENGINE_STAND_IN_HEADER, ZERO_COMPUTE_STAND_IN
from services.replica.llm_config import EngineConfig, LLMAppConfig, PrefillDecodeRole
from services.replica.middleware.replica_headers import ReplicaHeadersMiddleware
from services.replica.zero_compute_engine import STAND_IN_WORD, ZeroComputeEngineStandIn

WORD_ID = 7
PROMPT_IDS = [3, 4, 5]


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert text == STAND_IN_WORD and not add_special_tokens
        return [WORD_ID]

    def decode(self, ids: list[int]) -> str:
        return "".join(" w" if i == WORD_ID else "?" for i in ids)


class FakeEngine:
    """Only what the stand-in reads; `generate` and `abort` fail loudly, as the stand-in must not fall through."""

    model_config = types.SimpleNamespace(is_encoder_decoder=False, max_model_len=20)
    served_by = "the real engine"

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    async def generate(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the real engine generated")

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the real engine was asked to abort")


def _outputs(kind: RequestOutputKind, max_tokens: int | None, **params: Any) -> list[RequestOutput]:
    stand_in = ZeroComputeEngineStandIn(FakeEngine())  # type: ignore[arg-type]
    sampling = SamplingParams(max_tokens=max_tokens, output_kind=kind, **params)
    prompt = tokens_input(PROMPT_IDS, prompt="the prompt")

    async def collect() -> list[RequestOutput]:
        return [out async for out in stand_in.generate(prompt, sampling, "req-1", priority=0, lora_request=None)]

    return asyncio.run(collect())


def test_a_streamed_request_gets_one_delta_per_token_and_a_length_finish() -> None:
    outputs = _outputs(RequestOutputKind.DELTA, 5)
    assert len(outputs) == 5
    assert [out.outputs[0].token_ids for out in outputs] == [[WORD_ID]] * 5
    assert "".join(out.outputs[0].text for out in outputs) == " w" * 5
    assert [out.finished for out in outputs] == [False] * 4 + [True]
    assert [out.outputs[0].finish_reason for out in outputs] == [None] * 4 + ["length"]
    for out in outputs:
        assert out.request_id == "req-1"
        assert out.prompt_token_ids == PROMPT_IDS and out.prompt == "the prompt"
        assert out.num_cached_tokens == 0


def test_a_non_streamed_request_gets_one_final_output_with_every_token() -> None:
    (final,) = _outputs(RequestOutputKind.FINAL_ONLY, 6)
    assert final.finished
    (completion,) = final.outputs
    assert list(completion.token_ids) == [WORD_ID] * 6
    assert completion.text == " w" * 6
    assert completion.finish_reason == "length"
    assert final.prompt_token_ids == PROMPT_IDS


def test_a_cumulative_request_gets_every_token_so_far_each_time() -> None:
    outputs = _outputs(RequestOutputKind.CUMULATIVE, 3)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [1, 2, 3]
    assert outputs[-1].outputs[0].text == " w" * 3


def test_without_max_tokens_it_fills_the_model_length() -> None:
    (final,) = _outputs(RequestOutputKind.FINAL_ONLY, None)
    assert len(final.outputs[0].token_ids) == FakeEngine.model_config.max_model_len - len(PROMPT_IDS)


def test_no_detokenize_gives_tokens_without_text() -> None:
    (final,) = _outputs(RequestOutputKind.FINAL_ONLY, 4, detokenize=False)
    assert final.outputs[0].text == ""
    assert len(final.outputs[0].token_ids) == 4


@pytest.mark.parametrize("params", [{"n": 2}, {"logprobs": 1}, {"prompt_logprobs": 1}])
def test_what_it_cannot_fake_is_refused_as_an_invalid_request(params: dict[str, Any]) -> None:
    with pytest.raises(VLLMValidationError):
        _outputs(RequestOutputKind.DELTA, 4, **params)


def test_every_other_attribute_is_the_real_engines_and_abort_is_harmless() -> None:
    stand_in = ZeroComputeEngineStandIn(FakeEngine())  # type: ignore[arg-type]
    assert stand_in.served_by == "the real engine"
    assert stand_in.model_config is FakeEngine.model_config
    asyncio.run(stand_in.abort("req-1"))
    asyncio.run(stand_in.abort(["req-1", "req-2"], internal=True))


def test_a_cancelled_stream_just_stops() -> None:
    stand_in = ZeroComputeEngineStandIn(FakeEngine())  # type: ignore[arg-type]
    sampling = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)

    async def read_two_then_close() -> int:
        stream = stand_in.generate(tokens_input(PROMPT_IDS), sampling, "req-2")
        seen = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return len(seen)

    assert asyncio.run(read_two_then_close()) == 2


def test_the_replica_names_its_stand_in_on_every_response() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: Any) -> None:
        sent.append(message)

    middleware = ReplicaHeadersMiddleware(app, "r1", echo_request_id=False, engine_stand_in=ZERO_COMPUTE_STAND_IN)
    asyncio.run(middleware({"type": "http", "headers": []}, None, send))  # type: ignore[arg-type]
    assert (ENGINE_STAND_IN_HEADER.encode(), ZERO_COMPUTE_STAND_IN.encode()) in sent[0]["headers"]


def test_the_stand_in_is_opt_in_and_never_a_prefill_decode_role() -> None:
    engine = EngineConfig(model="m")
    assert LLMAppConfig(engine=engine).engine_stand_in is None
    assert LLMAppConfig(engine=engine, engine_stand_in="zero_compute").engine_stand_in == ZERO_COMPUTE_STAND_IN
    with pytest.raises(ValueError, match="unknown|literal|Input should be"):
        LLMAppConfig(engine=engine, engine_stand_in="fast")
    with pytest.raises(ValueError, match="prefill/decode"):
        LLMAppConfig(
            engine=engine,
            engine_stand_in="zero_compute",
            prefill_decode=PrefillDecodeRole(role="decode", prefill_app="p"),
        )
