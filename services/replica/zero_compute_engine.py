"""A zero-compute engine stand-in, for benchmarks only: it isolates the proxies' overhead by taking the engine out of
the way. Never used by the end-to-end tests or by any team topology; every response of a replica running it says
so in `x-serve-engine-stand-in` (base.contracts).

`ZeroComputeEngineStandIn` wraps a real, started vLLM `AsyncLLM` whose `generate` answers `max_tokens` copies of one
token without a model step. What it fakes and what it refuses: services/replica/README.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers.inputs.preprocess import extract_prompt_components
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from base.contracts import ZERO_COMPUTE_STAND_IN

# A whole word of the tiny model's vocabulary: it decodes standalone, so N copies decode to N times its text.
STAND_IN_WORD = " token"


class ZeroComputeEngineStandIn:
    """The real engine `engine` for everything but generation, which it answers without running the model."""

    name = ZERO_COMPUTE_STAND_IN

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine
        tokenizer = engine.get_tokenizer()
        self.token_id = tokenizer.encode(STAND_IN_WORD, add_special_tokens=False)[0]
        self.token_text = tokenizer.decode([self.token_id])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """`AsyncLLM.generate`'s outputs for `max_tokens` stand-in tokens; `kwargs` (LoRA, priority, trace headers,
        data-parallel rank, ...) change nothing here."""
        _refuse_what_cannot_be_faked(sampling_params)
        components = extract_prompt_components(self._engine.model_config, prompt)
        prompt_token_ids = components.token_ids
        if prompt_token_ids is None:
            prompt_token_ids = [0] * len(components.embeds)  # as vLLM's output processor does for embeds
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self._engine.model_config.max_model_len - len(prompt_token_ids)
        kind = sampling_params.output_kind
        text = self.token_text if sampling_params.detokenize else ""
        for count in range(1, max_tokens + 1):
            if count > 1:
                await asyncio.sleep(0)
            finished = count == max_tokens
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            emitted = 1 if kind == RequestOutputKind.DELTA else count
            completion = CompletionOutput(
                index=0,
                text=text * emitted,
                token_ids=[self.token_id] * emitted,
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="length" if finished else None,
            )
            yield RequestOutput(
                request_id=request_id,
                prompt=components.text,
                prompt_token_ids=prompt_token_ids,
                prompt_logprobs=None,
                outputs=[completion],
                finished=finished,
                num_cached_tokens=0,
                num_cache_creation_tokens=0,
            )

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Nothing to abort: the stand-in's requests never reach the real engine (a cancelled `generate` just
        stops)."""


def _refuse_what_cannot_be_faked(params: SamplingParams) -> None:
    if params.n != 1:
        raise VLLMValidationError("the zero-compute engine stand-in answers n=1 only", parameter="n", value=params.n)
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise VLLMValidationError("the zero-compute engine stand-in computes no logprobs", parameter="logprobs")
