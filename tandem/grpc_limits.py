"""Limits of the gRPC surface, in one place: message bytes, the repeated fields that would
otherwise only be bounded by them, and the keepalive both ends of a long-lived stream agree on.

gRPC's implicit default (4 MiB received, unlimited sent) is wrong both ways here: the largest
legitimate message is an EAGLE re-open (OpenSession carrying the session's fp16 features, 2 *
hidden_size bytes per position), which for the default target is 8192 * 576 * 2 B = 9.4 MB,
while a verifier's GenerateRequest never needs more than 5 bytes per context token. So every
server and channel sets both limits explicitly from `max_message_bytes`: twice the largest
legitimate message for its model, never below DEFAULT_MAX_MESSAGE_BYTES. A larger message is
refused by the transport with RESOURCE_EXHAUSTED before it is parsed.
"""
from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's own ceiling (message lengths are int32)
_ID_BYTES = 5  # a token id (a non-negative int32) as a varint, at most
# Everything but ids and features: names, sampling, trace context, tenant, MAX_STOP_TOKEN_IDS.
_FIXED_BYTES = 1 << 20

# Session ids are chosen by the gateway ("chatcmpl-" + 32 hex digits); one travels in every
# draft message and keys the verifier's and the draft worker's state, so bound it.
MAX_SESSION_ID_CHARS = 256
# Stop tokens are a handful in practice (EOS plus the request's own); each session keeps a set.
MAX_STOP_TOKEN_IDS = 1024


def max_message_bytes(context_length: int, hidden_size: int = 0) -> int:
    """The message limit of a worker whose sessions reach context_length tokens and, when
    hidden_size > 0, carry fp16 features of that width per position."""
    largest = context_length * (_ID_BYTES + 2 * hidden_size) + _FIXED_BYTES
    return min(max(DEFAULT_MAX_MESSAGE_BYTES, 2 * largest), GRPC_MAX_MESSAGE_BYTES)


def message_options(limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Server or channel options capping received and sent messages at `limit` bytes."""
    return [("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit)]


# A Speculate stream lives for hours. A link whose peer stops answering (a black-holed network,
# a frozen host) must break, not hold its sessions for the stream's day-long deadline: the
# verifier's channel pings every KEEPALIVE_S, and a ping unanswered for KEEPALIVE_TIMEOUT_S
# closes the transport. The draft server lets a ping come every MIN_PING_INTERVAL_MS at most;
# more often counts as abuse.
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 10.0, 5.0
MIN_PING_INTERVAL_MS = 5000


def keepalive_options(every_s: float = KEEPALIVE_S,
                      timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple[str, int]]:
    """Channel options: ping every `every_s`, even without calls; give up after `timeout_s`."""
    return [("grpc.keepalive_time_ms", int(every_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),  # newer gRPC cores use it
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def keepalive_server_options(min_ping_interval_ms: int = MIN_PING_INTERVAL_MS
                             ) -> list[tuple[str, int]]:
    """Server options: let clients keep idle streams alive with pings at most this often."""
    return [("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", min_ping_interval_ms)]


# The draft server pings too: a verifier that vanished without closing its connection (its
# host gone, a partition) would otherwise hold its sessions, and their KV, for gRPC's default
# two hours. Every SERVER_KEEPALIVE_S a ping, unanswered for SERVER_KEEPALIVE_TIMEOUT_S, ends
# the transport and with it the peer's streams: found in well under a minute.
SERVER_KEEPALIVE_S, SERVER_KEEPALIVE_TIMEOUT_S = 30.0, 10.0


def server_ping_options(every_s: float = SERVER_KEEPALIVE_S,
                        timeout_s: float = SERVER_KEEPALIVE_TIMEOUT_S) -> list[tuple[str, int]]:
    """Server options: ping each client every `every_s`, streams idle or not (an idle stream
    still holds sessions); drop the connection after `timeout_s` without an answer."""
    return [("grpc.keepalive_time_ms", int(every_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),  # newer gRPC cores use it
            ("grpc.http2.max_pings_without_data", 0)]
