"""Traces across the path (off by default): the settings (`Tracing`, a spec's `observability.tracing`), a process's
own OpenTelemetry tracer (`ProcessTracer`) and W3C trace context in and out of a request's headers.

A process of sluice (a router, an LLM replica) traces with a `TracerProvider` of its own, never the global one: vLLM
sets the global provider itself when its engine is given `--otlp-traces-endpoint`, in the same replica process.
Spans go to an OTLP/gRPC receiver in batches; the sampler follows the parent's decision (`traceparent`'s sampled flag)
and samples a trace it starts at `sample_ratio`. Why, and what each span holds: docs/stacks.md (Tracing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, Field, field_validator

from base.contracts import TRACEPARENT_HEADER
from base.spec_config import SPEC_SECTION_CONFIG

# A traced request's spans reach the receiver within this (OpenTelemetry's default is 5 s): a trace is read while
# the request is looked into, and a batch a second costs the process nothing it would notice.
EXPORT_DELAY_S = 1.0
# How long a stopping process waits for its last spans to be sent.
FLUSH_TIMEOUT_S = 5.0
# The share of traces a process starts itself (a request with no `traceparent`) that are sampled by default: a
# traced request costs its spans' export at every hop, which at thousands of requests a second would load the
# receiver more than the stack; a request whose `traceparent` says sampled is always traced, whatever the ratio.
SAMPLE_RATIO_DEFAULT = 0.01
# Each process's `service.name` on its spans: a router's, an LLM replica's, and its vLLM engine's own.
ROUTER_SERVICE = "sluice-router"
REPLICA_SERVICE = "sluice-replica"
ENGINE_SERVICE = "vllm"
# `host:port`, or `http://host:port`: an OTLP/gRPC receiver without TLS (vLLM's exporter never uses TLS).
_ENDPOINT = re.compile(r"^(http://)?[A-Za-z0-9.\-]+:\d{1,5}$|^http://\[[0-9A-Fa-f:]+\]:\d{1,5}$")
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing(BaseModel):
    """Traces across the path: the frontend's route call, the router's decision, the replica's request and vLLM's
    own spans under one trace id, sent to an OTLP/gRPC receiver."""

    model_config = SPEC_SECTION_CONFIG

    otlp_endpoint: str | None = None
    """The OTLP/gRPC receiver the routers, replicas and engines send spans to (`host:port` or `http://host:port`, no
    TLS); None: tracing is off and nothing on the request's path changes."""
    sample_ratio: float = Field(SAMPLE_RATIO_DEFAULT, ge=0, le=1)
    """The share of requests without a sampled `traceparent` that are traced (a trace sluice starts itself). 0.01 by
    default: a traced request exports spans at every hop, more than a collector takes at full traffic; a request that
    comes with a sampled `traceparent` is always traced."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _grpc_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not _ENDPOINT.match(value):
            raise ValueError(
                f"{value!r}: an OTLP/gRPC receiver as host:port or http://host:port (no TLS: vLLM's exporter has none)"
            )
        return value

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def url(self) -> str:
        """The receiver as an http:// URL, the form both OpenTelemetry's exporter and vLLM's flag read alike."""
        assert self.otlp_endpoint is not None
        return self.otlp_endpoint if self.otlp_endpoint.startswith("http://") else f"http://{self.otlp_endpoint}"

    def engine_env(self, service_name: str) -> dict[str, str]:
        """The environment vLLM's own tracer reads (its provider is OpenTelemetry's default one): its service's name,
        the same sampling as sluice's, and the same export delay."""
        return {
            "OTEL_SERVICE_NAME": service_name,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(self.sample_ratio),
            "OTEL_BSP_SCHEDULE_DELAY": str(int(EXPORT_DELAY_S * 1000)),
        }


class ProcessTracer:
    """A process's own tracer: `service_name` on every span, sampled parent-first then at the ratio, exported in
    batches to the receiver until `shutdown`."""

    def __init__(self, tracing: Tracing, service_name: str) -> None:
        self._provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service_name}),
            sampler=ParentBased(TraceIdRatioBased(tracing.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=tracing.url, insecure=True)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_S * 1000))
        self.tracer = self._provider.get_tracer("sluice")

    def shutdown(self) -> None:
        """Send what is still batched (within `FLUSH_TIMEOUT_S`) and stop."""
        self._provider.force_flush(int(FLUSH_TIMEOUT_S * 1000))
        self._provider.shutdown()


def parent_context(headers: Mapping[str, str]) -> Context:
    """The trace context a request's W3C headers carry (`traceparent`, `tracestate`; lower-case names); an empty
    context when they carry none or a malformed one: the span started in it is a new trace's root."""
    return _PROPAGATOR.extract(headers)


def traceparent(span: trace.Span) -> str | None:
    """The `traceparent` header that makes the next hop's spans children of `span` (None for an invalid span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT_HEADER)
