"""One OpenTelemetry span per traced draft session, a child of the verifier's session span.

The verifier puts its span's W3C headers in each Open (in the message, not gRPC metadata,
because one stream carries many sessions); untraced sessions cost nothing here.
"""
from __future__ import annotations

from opentelemetry import trace

from tandem import telemetry, tracing
from tandem.spec import Close, Control, Open, Reply, SessionError


class SessionSpans:
    """The spans of one Speculate stream's sessions, fed its control messages and replies."""

    def __init__(self) -> None:
        self.tracer = telemetry.tracer("draft")
        self.spans: dict[str, trace.Span] = {}
        self.tokens: dict[str, int] = {}

    def control(self, cmd: Control) -> None:
        if isinstance(cmd, Open) and cmd.trace_context:
            session_id = cmd.session_id
            self.end(session_id)  # a reopen replaces the session
            self.spans[session_id] = self.tracer.start_span(
                telemetry.SPAN_DRAFT, context=tracing.extract(cmd.trace_context),
                kind=trace.SpanKind.SERVER, attributes={telemetry.ATTR_SESSION: session_id})
            self.tokens[session_id] = 0
        elif isinstance(cmd, Close):
            self.end(cmd.session_id)

    def reply(self, item: Reply) -> None:
        if item.session_id not in self.spans:
            return
        if isinstance(item, SessionError):
            self.end(item.session_id, error=item.message)
        else:
            self.tokens[item.session_id] += 1

    def end(self, session_id: str, error: str = "") -> None:
        span = self.spans.pop(session_id, None)
        if span is not None:
            span.set_attribute(telemetry.ATTR_TOKENS_DRAFTED, self.tokens.pop(session_id, 0))
            if error:
                span.set_status(trace.StatusCode.ERROR, error)
            span.end()

    def end_all(self) -> None:
        for session_id in list(self.spans):
            self.end(session_id)
