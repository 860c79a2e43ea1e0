"""An in-test OTLP/gRPC trace receiver on 127.0.0.1: OpenTelemetry's own `TraceService` over grpcio, keeping every span
it is sent (its service's name, its own name, its trace and parent ids), so a test can read a trace back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.support.ports import free_port

LOOPBACK = "127.0.0.1"
SERVICE_NAME_KEY = "service.name"
# How long a stopping receiver lets a call in progress finish.
STOP_GRACE_S = 2.0


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(  # noqa: N802 - the gRPC service's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attributes.get(SERVICE_NAME_KEY, "")
            for scope_spans in resource_spans.scope_spans:
                received += [
                    ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                    for s in scope_spans.spans
                ]
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPReceiver:
    """The receiver at `endpoint` (`127.0.0.1:<port>`) while running."""

    def __init__(self, service: _TraceService, port: int) -> None:
        self._service = service
        self.endpoint = f"{LOOPBACK}:{port}"

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._service.lock:
            return list(self._service.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received so far under `trace_id` (32 hex digits)."""
        return [span for span in self.spans() if span.trace_id == trace_id]


@contextmanager
def otlp_receiver() -> Iterator[OTLPReceiver]:
    """A receiver on a free loopback port, stopped on exit."""
    service = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = free_port()
    server.add_insecure_port(f"{LOOPBACK}:{port}")
    server.start()
    try:
        yield OTLPReceiver(service, port)
    finally:
        server.stop(STOP_GRACE_S).wait(STOP_GRACE_S)
