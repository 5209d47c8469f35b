"""host:port strings that survive IPv6: one way to build them, one way to take them apart.

Pod IPs on an IPv6 (or dual-stack) cluster look like fd00::1, so `f"{ip}:{port}"` yields
"fd00::1:50051", which nothing can parse back. Addresses here always bracket an IPv6 literal
("[fd00::1]:50051"), the form gRPC targets, URLs and our Redis registry all understand.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

# gRPC name-resolver targets passed through as they are (e.g. dns:///verifier:50051 for
# client-side balancing); only plain host:port strings are parsed here.
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def _check_port(port: int | str, addr: str) -> int:
    text = str(port)
    if not text.isascii() or not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError(f"{addr!r}: the port must be a number in [0, 65535], got {text!r}")
    return int(text)


def join_host_port(host: str, port: int | str) -> str:
    """'host:port', with an IPv6 literal bracketed ('[::1]:50051'); an already bracketed host
    is kept as it is."""
    if not host:
        raise ValueError("an address needs a host, got an empty one")
    _check_port(port, f"{host}:{port}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def split_host_port(addr: str) -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port' (brackets removed). A bare IPv6 address
    ('::1:50051' is ambiguous) or a missing or bad port is a ValueError saying so."""
    if not isinstance(addr, str) or not addr:
        raise ValueError(f"expected host:port, got {addr!r}")
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        if not sep or not host:
            raise ValueError(f"{addr!r}: an unclosed or empty '[' in the address")
        if not rest.startswith(":"):
            raise ValueError(f"{addr!r}: expected [host]:port, the port is missing")
        return host, _check_port(rest[1:], addr)
    host, sep, port = addr.rpartition(":")
    if not sep:
        raise ValueError(f"{addr!r}: expected host:port, the port is missing")
    if ":" in host:
        raise ValueError(f"{addr!r}: an IPv6 address needs brackets, e.g. [{host}]:{port} "
                         "(or [::1]:50051)")
    if not host:
        raise ValueError(f"{addr!r}: expected host:port, the host is missing")
    return host, _check_port(port, addr)


def check_target(addr: str) -> str:
    """A dialable gRPC target: host:port (checked by split_host_port) or a name-resolver URI
    (dns:///name:port, unix:path, ...), returned unchanged."""
    if isinstance(addr, str) and addr.startswith(_GRPC_SCHEMES):
        return addr
    split_host_port(addr)
    return addr


def advertised(address: str, advertise_host: str, host: str, port: int) -> str:
    """What a worker registers for others to dial: `address` as given (checked), else
    advertise_host (or the bind host) joined with the bound port."""
    if address:
        split_host_port(address)
        return address
    return join_host_port(advertise_host or host, port)


def has_ipv6_loopback() -> bool:
    """Whether this host can bind ::1 (containers and CI runners often have IPv4 only)."""
    import socket

    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range: one the kernel hands out (bind to
    port 0) is in that range, where an outgoing connection can take it before the server
    binds it (a gateway failed to start so on a busy host)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        with socket.socket(family) as s:
            try:
                s.bind((host.strip("[]"), port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(family) as s:  # all tried were taken: any the kernel gives
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
