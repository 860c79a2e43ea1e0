"""The engine's load as its scheduler reports it, served to routers at `ENGINE_LOAD_PATH` (`EngineLoads`).

vLLM hands every engine step's scheduler statistics to its stat loggers (`StatLoggerBase.record`, in the replica's
process, whatever runs the engine core); `load_logger_factory` adds one that keeps the newest figures per engine
rank: requests running and waiting, the KV tokens in use (vLLM reports the share of its blocks in use; times the
blocks and the block size), the cache's size, the prefix cache's queries and hits summed over the steps, and the
recent mean time per request (`RequestSeconds`, from the finished requests' end-to-end latency). The
prompt tokens still to compute are not among vLLM's statistics: the router estimates them from the waiting requests
(`routers.engine_load`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from base.route_wire import EngineLoad, EngineLoads
from services.replica.request_seconds import RequestSeconds

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class EngineLoadBoard:
    """The newest load per engine rank."""

    def __init__(self) -> None:
        self.ranks: dict[int, EngineLoad] = {}

    def report(self) -> EngineLoads:
        return EngineLoads(ranks=dict(self.ranks))


def load_logger_factory(board: EngineLoadBoard) -> Any:
    """A vLLM stat logger factory (`AsyncLLM(stat_loggers=[...])`) whose loggers write to `board`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineLoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            self._cache = vllm_config.cache_config
            # vLLM hands each step's prefix cache counts; the report carries their sums.
            self._queries: dict[int, int] = {}
            self._hits: dict[int, int] = {}
            self._request_seconds: dict[int, RequestSeconds] = {}

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
            request_seconds = self._request_seconds.setdefault(engine_idx, RequestSeconds())
            for finished in iteration_stats.finished_requests if iteration_stats is not None else ():
                request_seconds.finished(finished.e2e_latency)
            if scheduler_stats is None:
                return
            blocks = self._cache.num_gpu_blocks or 0
            prefix = scheduler_stats.prefix_cache_stats
            self._queries[engine_idx] = self._queries.get(engine_idx, 0) + prefix.queries
            self._hits[engine_idx] = self._hits.get(engine_idx, 0) + prefix.hits
            board.ranks[engine_idx] = EngineLoad(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs,
                kv_tokens_used=round(scheduler_stats.kv_cache_usage * blocks * self._cache.block_size),
                kv_tokens_total=blocks * self._cache.block_size or None,
                prefix_cache_queries=self._queries[engine_idx],
                prefix_cache_hits=self._hits[engine_idx],
                request_seconds=request_seconds.value,
            )

        def log_engine_initialized(self) -> None:
            """Nothing to say: the board fills at the first step."""

    return EngineLoadLogger
