"""Spans reach a real OTLP receiver on loopback over both transports the manifests may ask for.

The receivers are the OTLP wire services themselves (opentelemetry-proto): the collector's gRPC
TraceService on one port and its HTTP `POST /v1/traces` on another, as on 4317 and 4318.
"""
from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tandem import telemetry

pytestmark = pytest.mark.contract


class _GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: N802 (the proto's name)
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _span_names(requests) -> list[str]:
    return [span.name for req in requests for rs in req.resource_spans
            for ss in rs.scope_spans for span in ss.spans]


@pytest.fixture
def grpc_receiver():
    receiver = _GrpcReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", receiver.requests
    server.stop(None)


@pytest.fixture
def http_receiver():
    requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/traces":
                self.send_response(404)
            else:
                requests.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()


def _export_one_span(name: str) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "tandem-test"}))
    provider.add_span_processor(SimpleSpanProcessor(telemetry.otlp_exporter()))
    with provider.get_tracer("tandem.test").start_as_current_span(name):
        pass
    provider.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_the_receiver_of_the_configured_protocol(monkeypatch, protocol,
                                                             grpc_receiver, http_receiver):
    receivers = {"grpc": grpc_receiver, "http/protobuf": http_receiver}
    endpoint, got = receivers[protocol]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    _export_one_span(f"round-{protocol}")
    assert _span_names(got) == [f"round-{protocol}"]
    other = http_receiver if protocol == "grpc" else grpc_receiver
    assert other[1] == []  # nothing went to the other transport


def test_the_traces_specific_protocol_wins_and_http_is_the_default(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert telemetry.otlp_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert telemetry.otlp_protocol() == "grpc"


def test_an_unknown_protocol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc.*http/json|http/json"):
        telemetry.otlp_exporter()
