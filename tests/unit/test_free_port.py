"""free_port picks below the kernel's ephemeral range: a port bound to 0 and released can be
taken by an outgoing connection before the server binds it."""
import socket

import pytest

from tandem.netaddr import _ephemeral_low, free_port

pytestmark = pytest.mark.unit


def test_free_ports_are_bindable_and_outside_the_ephemeral_range():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports)
    assert len(set(ports)) > 10  # spread, so two picks rarely meet
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_a_taken_port_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]

        class Draws:  # the taken port twice, then the ports below it
            def __init__(self):
                self.ports = [taken, taken, *range(taken - 1, taken - 60, -1)]
                self.drawn = []

            def randrange(self, low, high):
                self.drawn.append(self.ports.pop(0))
                return self.drawn[-1]

        draws = Draws()
        monkeypatch.setattr("tandem.netaddr._ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr("tandem.netaddr.random.SystemRandom", lambda: draws)
        port = free_port()
        # Another process may hold the ports right below (this host's own outgoing
        # connections take ephemeral ones): the first bindable one after the taken port.
        assert draws.drawn[:2] == [taken, taken] and port == draws.drawn[-1] < taken
