"""The gateway's listening socket (gateway/serve.py:listen): connections accepted from it get
TCP_NODELAY, as uvicorn's own bind gives them. Without it every response on a kept-alive
connection after the first waited ~40 ms for the client's delayed ACK (the OpenAI clients keep
their connections alive), measured through `tandem up`: TTFT 65 ms reused against 27 fresh."""
import asyncio
import socket

import pytest

from gateway.serve import listen
from tandem.netaddr import has_ipv6_loopback

pytestmark = pytest.mark.unit


def _accepted_nodelay(host: str) -> int:
    async def main():
        sock = listen(host, 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(host, sock.getsockname()[1])
            value = await asyncio.wait_for(seen, 5)
            writer.close()
            return value
        finally:
            server.close()

    return asyncio.run(main())


def test_accepted_connections_are_nodelay():
    assert _accepted_nodelay("127.0.0.1")
    if has_ipv6_loopback():
        assert _accepted_nodelay("::1")
