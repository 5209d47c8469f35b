"""tandem.grpc_limits' keepalive options: both ends of a Speculate stream from one place."""
import pytest

from tandem.grpc_limits import (
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MIN_PING_INTERVAL_MS,
    keepalive_options,
    keepalive_server_options,
)

pytestmark = pytest.mark.unit


def test_channel_pings_and_gives_up_in_milliseconds():
    opts = dict(keepalive_options(0.5, 1.0))
    assert opts["grpc.keepalive_time_ms"] == 500
    assert opts["grpc.keepalive_timeout_ms"] == opts["grpc.http2.ping_timeout_ms"] == 1000
    assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert opts["grpc.http2.max_pings_without_data"] == 0
    assert dict(keepalive_options())["grpc.keepalive_time_ms"] == int(KEEPALIVE_S * 1000)


def test_server_allows_the_channels_pings():
    opts = dict(keepalive_server_options())
    assert opts == {"grpc.keepalive_permit_without_calls": 1,
                    "grpc.http2.min_recv_ping_interval_without_data_ms": MIN_PING_INTERVAL_MS}
    # the verifier's pings never come more often than the draft server allows
    assert KEEPALIVE_S * 1000 >= MIN_PING_INTERVAL_MS > 0 and KEEPALIVE_TIMEOUT_S > 0
    assert dict(keepalive_server_options(100))[
        "grpc.http2.min_recv_ping_interval_without_data_ms"] == 100
