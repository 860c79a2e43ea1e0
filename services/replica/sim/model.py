"""The timing model of the simulated engine (`SimEngine`): how long one continuous-batching step takes.

A step runs the batch's prefill chunks and one decode token of every sequence past its prefill, as vLLM v1 does:

    step_seconds = step_overhead_s
                 + prefill_tokens * prefill_s_per_token
                 + (decode_base_s + decode_seqs * decode_s_per_seq   when the step decodes at all)

The defaults describe Llama-3.1-8B in bf16 on one H100 served by vLLM, to an order of magnitude (a benchmark stand-in,
not a measurement of any one build):
- `step_overhead_s` 2 ms: scheduling, input preparation and sampling, paid by every step.
- `prefill_s_per_token` 60 µs: a token costs ~2 × 8e9 = 16 GFLOP; at ~270 TFLOP/s (about a quarter of the H100's
  dense bf16 peak, what prefill reaches) that is ~16,000 prompt tokens a second.
- `decode_base_s` 8 ms: decoding is memory-bound; each step reads the 16 GB of weights once (~5 ms at 3.35 TB/s,
  ~8 ms as reached), however many sequences it decodes.
- `decode_s_per_seq` 80 µs: each sequence adds its own KV reads (128 KiB per token of context, ~1,000 tokens) and
  its share of the matmuls.
- `block_size` 16 (vLLM's default); `num_blocks` 2,048 (32,768 tokens): a real H100 holds ~25,000 such blocks for
  this model (~50 GB left for the cache at 0.9 memory utilization, 128 KiB per token), so the default is smaller on
  purpose: a benchmark of modest size reaches eviction, where routing by cache contents matters, and 64 simulated
  replicas stay small in one process.
- `max_num_seqs` 64 and `max_num_batched_tokens` 4,096: the batch limit and chunked-prefill token budget per step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SimModel(BaseModel):
    """One model on one accelerator, as the simulator sees it: cache geometry, batch limits and step costs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "llama-3.1-8b-h100"
    block_size: int = Field(default=16, gt=0)
    num_blocks: int = Field(default=2048, gt=0)
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=4096, gt=0)
    step_overhead_s: float = Field(default=0.002, ge=0)
    prefill_s_per_token: float = Field(default=0.00006, ge=0)
    decode_base_s: float = Field(default=0.008, ge=0)
    decode_s_per_seq: float = Field(default=0.00008, ge=0)

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        """How long a step that computes `prefill_tokens` prompt tokens and decodes `decode_seqs` sequences takes."""
        decode = self.decode_base_s + decode_seqs * self.decode_s_per_seq if decode_seqs else 0.0
        return self.step_overhead_s + prefill_tokens * self.prefill_s_per_token + decode
