"""tandem.netaddr: host:port strings that survive IPv6 pod IPs."""
import pytest

from gateway.config import GatewayConfig
from tandem.netaddr import advertised, check_target, join_host_port, split_host_port

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("host, port, want", [
    ("127.0.0.1", 50051, "127.0.0.1:50051"),
    ("verifier-0.tandem.svc", 50051, "verifier-0.tandem.svc:50051"),
    ("localhost", "8000", "localhost:8000"),
    ("::1", 50051, "[::1]:50051"),
    ("::", 0, "[::]:0"),
    ("fd00:10:244::1f", 50052, "[fd00:10:244::1f]:50052"),
    ("fe80::1%eth0", 1, "[fe80::1%eth0]:1"),
    ("[::1]", 50051, "[::1]:50051"),  # already bracketed: not twice
    ("0.0.0.0", 65535, "0.0.0.0:65535"),
])
def test_join_brackets_ipv6_only(host, port, want):
    assert join_host_port(host, port) == want


@pytest.mark.parametrize("host, port", [("", 1), ("h", -1), ("h", 65536), ("h", "x"),
                                        ("h", "1.5"), ("h", "")])
def test_join_refuses_bad_input(host, port):
    with pytest.raises(ValueError):
        join_host_port(host, port)


@pytest.mark.parametrize("addr, want", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)),
    ("verifier:0", ("verifier", 0)),
    ("[::1]:50051", ("::1", 50051)),
    ("[::]:8000", ("::", 8000)),
    ("[fd00:10:244::1f]:65535", ("fd00:10:244::1f", 65535)),
    ("[fe80::1%eth0]:9", ("fe80::1%eth0", 9)),
])
def test_split(addr, want):
    assert split_host_port(addr) == want


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "fd00::2", "name.example", "[::1]"])
@pytest.mark.parametrize("port", [0, 1, 50051, 65535])
def test_split_inverts_join(host, port):
    assert split_host_port(join_host_port(host, port)) == (host.strip("[]"), port)


@pytest.mark.parametrize("addr, words", [
    ("::1:50051", ["needs brackets", "[::1]:50051"]),
    ("fd00::1:50052", ["needs brackets", "[fd00::1]:50052"]),  # $(POD_IP):50052 on IPv6
    ("::1", ["needs brackets"]),
    ("localhost", ["port is missing"]),
    ("[::1]", ["port is missing"]),
    ("[::1]50051", ["port is missing"]),
    ("[::1:50051", ["unclosed"]),
    ("[]:1", ["empty"]),
    (":50051", ["host is missing"]),
    ("host:", ["port must be a number"]),
    ("host:http", ["port must be a number", "'http'"]),
    ("host:65536", ["[0, 65535]"]),
    ("host:-1", ["port must be a number"]),
    ("host:٣", ["port must be a number"]),  # a non-ASCII digit is not a port
    ("[::1]:x", ["port must be a number"]),
    ("", ["expected host:port"]),
])
def test_split_errors_say_what_is_wrong(addr, words):
    with pytest.raises(ValueError) as err:
        split_host_port(addr)
    for word in words:
        assert word in str(err.value)


def test_split_refuses_non_strings():
    with pytest.raises(ValueError):
        split_host_port(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["dns:///tandem-verifier:50051", "unix:/run/v.sock",
                                    "ipv6:[::1]:50051", "h:1", "[::1]:2"])
def test_check_target_passes_grpc_uris_and_host_port(target):
    assert check_target(target) == target


@pytest.mark.parametrize("target", ["::1:50051", "host", "fd00::1"])
def test_check_target_refuses_the_rest(target):
    with pytest.raises(ValueError):
        check_target(target)


@pytest.mark.parametrize("address, adv_host, host, port, want", [
    ("", "", "127.0.0.1", 50051, "127.0.0.1:50051"),
    ("", "fd00::7", "::", 50051, "[fd00::7]:50051"),  # --advertise-host=$(POD_IP)
    ("", "10.1.2.3", "0.0.0.0", 50052, "10.1.2.3:50052"),
    ("", "", "::1", 41000, "[::1]:41000"),
    ("[fd00::7]:50051", "ignored", "::", 1, "[fd00::7]:50051"),
    ("verifier-0:50051", "", "0.0.0.0", 1, "verifier-0:50051"),
])
def test_advertised(address, adv_host, host, port, want):
    assert advertised(address, adv_host, host, port) == want


def test_advertised_refuses_an_unbracketed_ipv6_address():
    with pytest.raises(ValueError, match="brackets"):
        advertised("fd00::7:50051", "", "::", 50051)


def test_gateway_static_lists_are_checked_the_same_way():
    config = GatewayConfig(static_verifiers=("[::1]:50051", "dns:///tandem-verifier:50051"),
                           static_drafts=("10.0.0.1:50052",))
    assert config.static_verifiers[0] == "[::1]:50051"
    with pytest.raises(ValueError, match="brackets"):
        GatewayConfig(static_verifiers=("fd00::1:50051",))
    with pytest.raises(ValueError, match="port is missing"):
        GatewayConfig(static_drafts=("draft",))


def test_worker_configs_check_their_addresses():
    from draft_service.config import DraftConfig
    from verify_service.config import VerifierConfig

    assert DraftConfig(host="::", port=50052).address == "[::]:50052"
    assert DraftConfig(host="[::1]", port=1).address == "[::1]:1"
    with pytest.raises(ValueError, match="brackets"):
        VerifierConfig(advertise_address="fd00::1:50051")
    with pytest.raises(ValueError, match="brackets"):
        VerifierConfig(draft_addresses=("::1:50052",))
    assert VerifierConfig(draft_addresses=("[::1]:50052",), advertise_host="::1")
