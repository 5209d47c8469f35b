"""Every telemetry name in one place: metrics, span names and attributes, tracing setup.

Tracing follows the standard OTEL_* environment: OTEL_TRACES_EXPORTER=otlp|console|none,
OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL (or their _TRACES_ forms) =
http/protobuf (the default, port 4318) or grpc (port 4317); with neither exporter nor endpoint
set, tracing is off (no-op tracer).
The spans of HTTP, gRPC and Redis and the W3C context between services come from the
OpenTelemetry instrumentation packages (tandem/tracing.py); the names here are Tandem's own.
Metrics use one prometheus_client registry per service object (no process-global state).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)

# ---- span names and attributes (OpenTelemetry GenAI semantic conventions + ours) ----------
SPAN_VERIFY = "verify"
SPAN_DRAFT = "draft"
EVENT_ROUND = "tandem.round"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_USAGE_INPUT = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
ATTR_SESSION = "tandem.session_id"
ATTR_METHOD = "tandem.speculation.method"
ATTR_TTFT_MS = "tandem.time_to_first_token_ms"
ATTR_DRAFTED = "tandem.round.drafted"
ATTR_ACCEPTED = "tandem.round.accepted"
ATTR_DRAFT_WAIT_MS = "tandem.round.draft_wait_ms"
ATTR_VERIFY_MS = "tandem.round.verify_ms"
ATTR_REJECTION_MS = "tandem.round.rejection_ms"
ATTR_TOKENS_DRAFTED = "tandem.draft.tokens"


def setup_tracing(service_name: str) -> bool:
    """Install a global tracer provider from OTEL_* env; returns whether tracing is on."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if disabled or exporter_name == "none" or (not exporter_name and not endpoint):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporter = ConsoleSpanExporter() if exporter_name == "console" else otlp_exporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


OTLP_PROTOCOLS = ("http/protobuf", "grpc")


def otlp_protocol() -> str:
    """The OTLP transport asked for by env (the signal-specific variable wins)."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol.strip().lower() not in OTLP_PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(OTLP_PROTOCOLS)}"
                         f", got {protocol!r}")
    return protocol.strip().lower()


def otlp_exporter():
    """The OTLP span exporter for otlp_protocol(); it reads its endpoint from the env."""
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def tracer(component: str) -> trace.Tracer:
    return trace.get_tracer(f"tandem.{component}")


# ---- Prometheus metrics ------------------------------------------------------------------
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _ByPosition:
    """A per-position counter's children, each looked up once: .labels() builds its key and
    takes a lock per call, and every round of every session counts its accepted positions."""

    def __init__(self, counter: Counter, **labels: str):
        self.counter, self.labels, self.children = counter, labels, []

    def children_to(self, n: int) -> None:  # positions 0..n-1 exist (at 0) from now on
        while len(self.children) < n:
            self.children.append(self.counter.labels(**self.labels,
                                                     position=str(len(self.children))))

    def inc_first(self, n: int) -> None:  # + 1 for each of positions 0..n-1
        self.children_to(n)
        for child in self.children[:n]:
            child.inc()


class VllmSpecDecodeMetrics:
    """vLLM v1's spec-decode counters under vLLM's own names, labels and meaning
    (vllm/v1/spec_decode/metrics.py), so that vLLM's dashboards and scripts read a verifier
    as they read vLLM: per verification round of a session with drafts, num_drafts + 1,
    num_draft_tokens + the drafts verified, num_accepted_tokens + those accepted, and
    num_accepted_tokens_per_pos{position=i} + 1 for each accepted position i (so the
    positions sum to num_accepted_tokens). Labels model_name (the served model) and engine
    ("0": one engine per verifier process); positions 0..num_positions - 1 exist from the
    start, at 0, as vLLM's do."""

    PREFIX = "vllm:spec_decode_"

    def __init__(self, registry: CollectorRegistry, model_name: str, num_positions: int = 0):
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)

        def counter(name: str, text: str) -> Counter:
            return Counter(self.PREFIX + name, text, names, registry=registry).labels(
                **self.labels)

        self.num_drafts = counter("num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("num_accepted_tokens",
                                           "Number of accepted tokens.")
        self.per_pos = Counter(self.PREFIX + "num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", [*names, "position"],
                               registry=registry)
        self._per_pos = _ByPosition(self.per_pos, **self.labels)
        self._per_pos.children_to(num_positions)

    def observe(self, drafted: int, accepted: int) -> None:
        """One verification round of one session that verified `drafted` >= 1 drafts."""
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        self.num_accepted_tokens.inc(accepted)
        self._per_pos.inc_first(accepted)


class VerifierMetrics:
    """vLLM spec-decode counters (Tandem's names, and vLLM's own: VllmSpecDecodeMetrics),
    round phases, and the gauges the autoscalers read."""

    def __init__(self, model_name: str = "tandem", num_positions: int = 0):
        r = self.registry = CollectorRegistry()
        self.vllm = VllmSpecDecodeMetrics(r, model_name, num_positions)
        self.num_drafts = Counter("tandem_spec_num_drafts", "Rounds that verified >= 1 draft "
                                  "token", registry=r)
        self.num_draft_tokens = Counter("tandem_spec_num_draft_tokens",
                                        "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter("tandem_spec_num_accepted_tokens",
                                           "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("tandem_spec_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted by position in the round",
                                        ["position"], registry=r)
        self.rounds = Counter("tandem_verifier_rounds", "Verification rounds", registry=r)
        self.round_phase = Histogram("tandem_round_phase_seconds", "Time of a round by phase",
                                     ["phase"], buckets=_PHASE_BUCKETS, registry=r)
        # Each round of each session observes these: .labels() looks its child up under a
        # lock each time (about 5% of a 32-session step's Python), so it is looked up once.
        self._phases = [self.round_phase.labels(phase=p)
                        for p in ("draft_wait", "verify", "rejection")]
        self._per_pos = _ByPosition(self.accepted_per_pos)
        self.ttft = Histogram("tandem_verifier_time_to_first_token_seconds", "Request arrival "
                              "to first committed token", buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("tandem_verifier_running_sessions", "Sessions decoding",
                             registry=r)
        self.waiting = Gauge("tandem_verifier_waiting_sessions", "Sessions queued or "
                             "preempted", registry=r)
        self.kv_usage = Gauge("tandem_verifier_kv_cache_usage_ratio", "Fraction of KV blocks "
                              "in use", registry=r)

    def bind_load(self, running: Callable[[], int], waiting: Callable[[], int],
                  kv_usage: Callable[[], float]) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def observe_round(self, drafted: int, accepted: int, wait_ms: float, verify_ms: float,
                      rejection_ms: float) -> None:
        self.rounds.inc()
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            self._per_pos.inc_first(accepted)
            self.vllm.observe(drafted, accepted)
        for child, ms in zip(self._phases, (wait_ms, verify_ms, rejection_ms)):
            child.observe(ms / 1e3)


class DraftMetrics:
    def __init__(self, sessions: Callable[[], int], queue_depth: Callable[[], int],
                 tokens: Callable[[], int]):
        r = self.registry = CollectorRegistry()
        Gauge("tandem_draft_sessions", "Sessions open on this draft worker",
              registry=r).set_function(sessions)
        Gauge("tandem_draft_queue_depth", "Sessions waiting to be drafted",
              registry=r).set_function(queue_depth)
        # A counter mirrored from the worker's own count (read at scrape time).
        Gauge("tandem_draft_tokens_drafted", "Draft tokens produced since start",
              registry=r).set_function(tokens)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_gateway_requests", "Requests by outcome",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("tandem_gateway_requests_in_flight", "Requests being served",
                               registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Request to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Gap between streamed "
                             "tokens (a round's tokens share one gap)", buckets=_PHASE_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Request to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # Set as the gateway reads Redis (tandem.redis_memory): writes fail when it is full.
        self.redis_memory = Gauge("tandem_redis_memory_usage_ratio", "Redis used_memory / "
                                  "maxmemory at the last reading (0 = no maxmemory)",
                                  registry=r)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> int:
    """Serve GET /metrics over HTTP on a daemon thread (404 elsewhere, unlike prometheus_client's
    server, which answers every path); returns the bound port (0 = any free). An IPv6 host
    works, "::" on every address."""
    import threading

    server = _http_server(host, port, _metrics_handler(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_address[1]


def _metrics_handler(registry: CollectorRegistry):
    from http.server import BaseHTTPRequestHandler

    from prometheus_client import CONTENT_TYPE_LATEST

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes every few seconds: not worth a log line
            pass

    return Handler


def _http_server(host: str, port: int, handler):
    import contextlib
    import socket
    from http.server import ThreadingHTTPServer

    host = host.strip("[]")  # "[::]" as well as "::"
    v6 = ":" in host

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if v6 else socket.AF_INET
        daemon_threads = True

        def server_bind(self):
            if v6:  # "::" serves IPv4 too (dual stack), whatever the host's sysctl default
                with contextlib.suppress(OSError):
                    self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    return Server((host, port), handler)
