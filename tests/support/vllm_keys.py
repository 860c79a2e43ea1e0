"""The keys `vllm bench serve --save-result` writes (vLLM 0.32, `vllm/benchmarks/serve.py`, a generation run
without `--save-detailed`), held here for the tests of `summary.json`."""

from __future__ import annotations

FIGURES = ("mean", "median", "std", "p99")
# A generation run's keys: setup and traffic, the benchmark's totals, then mean/median/std/p99 of each latency.
VLLM_SAVE_RESULT_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{figure}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for figure in FIGURES),
}  # fmt: skip
# With `--max-concurrency`, vLLM also writes how long requests waited for it.
CLIENT_QUEUE_KEYS = {f"{figure}_client_queue_time_ms" for figure in FIGURES}
