"""Data parallel across replicas (`data_parallel` mode `ranks`): each Serve replica of a gang is one vLLM DP rank.

Rank 0 publishes an address and a free port for vLLM's DP rendezvous in Ray's GCS key-value store under the gang's
id; the other ranks wait for it, then every rank starts vLLM with the external-DP flags. A dead rank restarts its
whole gang (a new id). Details: services/replica/README.md (data parallel).
"""

from __future__ import annotations

import json
import logging

import ray
from ray import serve
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from base.runtime import free_port
from base.waiting import async_wait_until
from services.replica.llm_config import EngineArgValue
from services.serve_internals import REPLICA_LOGGER

GANG_KEY_PREFIX = "sluice/dp-gang/"
RENDEZVOUS_TIMEOUT_S = 120.0
_POLL_S = 0.25
logger = logging.getLogger(REPLICA_LOGGER)


def _key(gang_id: str) -> bytes:
    return (GANG_KEY_PREFIX + gang_id).encode()


class RankGang:
    """This replica's place in its gang and the gang's DP rendezvous."""

    def __init__(self) -> None:
        context = serve.get_replica_context().gang_context
        if context is None:
            raise RuntimeError("data_parallel mode `ranks` needs Serve's gang scheduling (gang_scheduling_config)")
        self.gang_id = context.gang_id
        self.rank = context.rank
        self.size = context.world_size

    async def engine_args(self, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dict[str, EngineArgValue]:
        """vLLM's external-DP flags for this rank: rank 0 publishes the rendezvous, the others read it."""
        if self.rank == 0:
            host = ray.util.get_node_ip_address()
            address = {"host": host, "port": free_port(host)}
            _internal_kv_put(_key(self.gang_id), json.dumps(address).encode(), overwrite=True)
        else:
            address = await self._published(timeout_s)
        return {
            "data_parallel_rank": self.rank,
            "data_parallel_address": address["host"],
            "data_parallel_rpc_port": address["port"],
        }

    async def _published(self, timeout_s: float) -> dict:
        async def published() -> bytes | None:
            return _internal_kv_get(_key(self.gang_id))

        what = f"rank 0 of gang {self.gang_id} to publish its DP rendezvous address"
        return json.loads(await async_wait_until(timeout_s, published, what, _POLL_S, logger))

    def leave(self) -> None:
        """Rank 0 takes its gang's entry with it."""
        if self.rank == 0:
            _internal_kv_del(_key(self.gang_id))
