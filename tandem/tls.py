"""TLS and mutual TLS on every gRPC hop: gateway -> verifier -> draft worker.

One `TlsConfig` per process, from flags or TANDEM_TLS_* (in Kubernetes each role mounts its
own certificate's secret at the same path, so one set of names serves every role). A process
serves with its certificate and presents the same one when it dials a peer.
`require_client_cert` makes a server refuse clients whose certificate the CA did not sign
(mTLS); `client_names` then also refuses clients of another role: their certificate must name
one of them (a verifier takes the gateway's, a draft worker the verifier's), so a draft
worker's certificate cannot call a verifier as a gateway. `None` everywhere means plaintext,
the default.

Certificates are read when a server or channel is built: a rotated secret takes effect when
the process restarts.
"""
from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import grpc

from tandem.envflags import add_flag, boolean

ChannelOptions = Sequence[tuple[str, object]]

# What each file must hold: a swapped --tls-cert/--tls-key fails here, not inside a handshake.
_PEM_MARKERS = MappingProxyType({"certificate": b"CERTIFICATE-----",
                                 "private key": b"PRIVATE KEY-----", "CA": b"CERTIFICATE-----"})


def _check_pem(path: str, what: str) -> None:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"TLS {what} file {path!r} cannot be read: "
                         f"{exc.strerror or exc}") from None
    if _PEM_MARKERS[what] not in data:
        raise ValueError(f"TLS {what} file {path!r} holds no PEM {what} "
                         f"(no '-----BEGIN ...{_PEM_MARKERS[what].decode()}' line)")


@dataclass(frozen=True)
class TlsConfig:
    """PEM file paths; a config with only `ca_file` is a client that presents no certificate."""

    cert_file: str = ""  # certificate (chain) served, and presented when dialling
    key_file: str = ""  # its private key
    ca_file: str = ""  # peers must chain to this; "" = the system roots (clients only)
    require_client_cert: bool = False  # mTLS: servers refuse clients the CA did not sign
    server_name: str = ""  # name checked in the server's certificate; "" = the dialled host
    # mTLS: a client's certificate must also name one of these (DNS or URI SAN; the CN when it
    # has no SAN): the roles allowed to call this server; () = any the CA signed
    client_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file", "server_name"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.require_client_cert, bool):
            raise ValueError(f"require_client_cert must be a bool, got "
                             f"{self.require_client_cert!r}")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a TLS certificate needs its private key and a key its "
                             "certificate: give both --tls-cert and --tls-key")
        if not (self.cert_file or self.ca_file):
            raise ValueError("TLS needs a certificate (--tls-cert and --tls-key) or a CA to "
                             "verify servers with (--tls-ca)")
        if self.require_client_cert and not (self.cert_file and self.ca_file):
            raise ValueError("--tls-client-auth (mTLS) needs --tls-ca to verify clients with "
                             "and --tls-cert/--tls-key to serve with")
        _check_client_names(self.client_names, self.require_client_cert)
        if self.server_name and (":" in self.server_name or
                                 any(c.isspace() for c in self.server_name)):
            raise ValueError(f"server_name must be a host name, got {self.server_name!r}")
        for path, what in ((self.cert_file, "certificate"), (self.key_file, "private key"),
                           (self.ca_file, "CA")):
            if path:
                _check_pem(path, what)

    @property
    def can_serve(self) -> bool:
        return bool(self.cert_file)


def check_serving(tls: object) -> None:
    """A worker config's `tls` field: None (plaintext) or a TlsConfig it can serve with."""
    if tls is not None and not (isinstance(tls, TlsConfig) and tls.can_serve):
        raise ValueError("tls must be None or a TlsConfig with a certificate and key to serve "
                         "with (--tls-cert, --tls-key)")


def _check_client_names(names: object, mtls: bool) -> None:
    if not isinstance(names, tuple) or not all(
            isinstance(n, str) and n and n == n.strip() and "," not in n for n in names):
        raise ValueError(f"client_names must be a tuple of names, got {names!r}")
    if names and not mtls:
        raise ValueError("--tls-client-names needs --tls-client-auth: a server sees a client's "
                         "certificate only when it requires one")


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cfg: TlsConfig) -> grpc.ServerCredentials:
    if not cfg.can_serve:
        raise ValueError("serving TLS needs --tls-cert and --tls-key")
    # Roots only with mTLS: given roots, a server also checks certificates it did not require.
    roots = _read(cfg.ca_file) if cfg.require_client_cert else None
    return grpc.ssl_server_credentials([(_read(cfg.key_file), _read(cfg.cert_file))],
                                       root_certificates=roots,
                                       require_client_auth=cfg.require_client_cert)


def channel_credentials(cfg: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(cfg.ca_file),
                                        private_key=_read(cfg.key_file),
                                        certificate_chain=_read(cfg.cert_file))


def channel_options(cfg: TlsConfig | None, options: ChannelOptions = ()) -> tuple:
    if cfg is None or not cfg.server_name:
        return tuple(options)
    return (*options, ("grpc.ssl_target_name_override", cfg.server_name))


def add_port(server: grpc.Server | grpc.aio.Server, address: str,
             cfg: TlsConfig | None) -> int:
    """Bind `address` over TLS (or plaintext when cfg is None); the bound port, 0 on failure."""
    if cfg is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(cfg))


def open_channel(address: str, cfg: TlsConfig | None,
                 options: ChannelOptions = ()) -> grpc.aio.Channel:
    from tandem.tracing import grpc_client_interceptors

    if cfg is None:
        return grpc.aio.insecure_channel(address, tuple(options),
                                         interceptors=grpc_client_interceptors())
    return grpc.aio.secure_channel(address, channel_credentials(cfg),
                                   channel_options(cfg, options),
                                   interceptors=grpc_client_interceptors())


def open_sync_channel(address: str, cfg: TlsConfig | None,
                      options: ChannelOptions = ()) -> grpc.Channel:
    """open_channel for blocking callers (the launcher's health checks)."""
    if cfg is None:
        return grpc.insecure_channel(address, tuple(options))
    return grpc.secure_channel(address, channel_credentials(cfg), channel_options(cfg, options))


def add_tls_flags(parser: argparse.ArgumentParser, serves: bool = True) -> None:
    """--tls-* flags reading TANDEM_TLS_*; `serves` adds --tls-client-auth (gRPC servers)."""
    group = parser.add_argument_group(
        "TLS", "gRPC between the services over TLS (default: plaintext). --tls-cert/--tls-key "
        "turn it on: a worker serves with that certificate, and every process presents it to "
        "the peers it dials, whose certificates must chain to --tls-ca.")
    add_flag(group, "--tls-cert", "TANDEM_TLS_CERT", "",
             help="PEM certificate (chain) to serve with and present as a client",
             metavar="FILE")
    add_flag(group, "--tls-key", "TANDEM_TLS_KEY", "", help="PEM private key of --tls-cert",
             metavar="FILE")
    add_flag(group, "--tls-ca", "TANDEM_TLS_CA", "",
             help="PEM CA bundle peers' certificates must chain to (default: system roots)",
             metavar="FILE")
    if serves:
        add_flag(group, "--tls-client-auth", "TANDEM_TLS_CLIENT_AUTH", False, boolean,
                 help="mutual TLS: refuse clients without a certificate signed by --tls-ca",
                 nargs="?", const=True, metavar="BOOL")
        add_flag(group, "--tls-client-names", "TANDEM_TLS_CLIENT_NAMES", "",
                 help="with --tls-client-auth: refuse clients whose certificate names none of "
                      "these (comma-separated DNS or URI names: the roles that may call, e.g. "
                      "a verifier takes the gateway's certificate only)", metavar="NAMES")
    add_flag(group, "--tls-server-name", "TANDEM_TLS_SERVER_NAME", "",
             help="name to verify in peers' certificates instead of the dialled host (workers "
                  "are dialled at their registered pod IPs, which certificates rarely name)",
             metavar="NAME")


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the --tls-* flags describe, or None when none is set (plaintext)."""
    values = {"cert_file": args.tls_cert or "", "key_file": args.tls_key or "",
              "ca_file": args.tls_ca or "",
              "require_client_cert": boolean(getattr(args, "tls_client_auth", False)),
              "server_name": args.tls_server_name or "",
              "client_names": split_names(getattr(args, "tls_client_names", "") or "")}
    return TlsConfig(**values) if any(values.values()) else None


def split_names(text: str) -> tuple[str, ...]:
    """'a, b' -> ('a', 'b')."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def tls_args(cfg: TlsConfig | None, serves: bool = True) -> list[str]:
    """The command-line flags that give a child process `cfg` (the launcher's)."""
    if cfg is None:
        return []
    args = []
    for flag, value in (("--tls-cert", cfg.cert_file), ("--tls-key", cfg.key_file),
                        ("--tls-ca", cfg.ca_file), ("--tls-server-name", cfg.server_name)):
        args += [f"{flag}={value}"] if value else []
    if serves and cfg.require_client_cert:
        args.append("--tls-client-auth=true")
    if serves and cfg.client_names:
        args.append(f"--tls-client-names={','.join(cfg.client_names)}")
    return args


def server_interceptors(cfg: TlsConfig | None) -> list:
    """The interceptors a server built with `cfg` puts first: the client-role check when
    cfg.client_names is set (none otherwise)."""
    return [ClientNameInterceptor(cfg.client_names)] if cfg and cfg.client_names else []


def peer_names(context) -> set[str]:
    """The names of a call's client certificate: its DNS and URI SANs, else its CN."""
    auth = context.auth_context()
    names = {v.decode(errors="replace") for key in ("peer_dns", "peer_uri")
             for v in auth.get(key, ())}
    if not names:  # an older gRPC without peer_dns: the SANs, then the CN
        names = {v.decode(errors="replace") for key in ("x509_subject_alternative_name",
                                                        "x509_common_name")
                 for v in auth.get(key, ())}
    return names


class ClientNameInterceptor(grpc.aio.ServerInterceptor):
    """Every call, health and reflection included, ends PERMISSION_DENIED before its handler
    runs unless the client's certificate names one of `names` (its role)."""

    def __init__(self, names: Sequence[str]):
        self.names = frozenset(names)

    async def _check(self, context) -> None:
        if not peer_names(context) & self.names:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this client's certificate is not of a role this server serves "
                                f"(it must name one of {', '.join(sorted(self.names))})")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        for attr, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                           ("stream_unary", grpc.stream_unary_rpc_method_handler),
                           ("unary_stream", grpc.unary_stream_rpc_method_handler),
                           ("stream_stream", grpc.stream_stream_rpc_method_handler)):
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(self._wrap(behavior),
                            request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    def _wrap(self, behavior):
        if inspect.isasyncgenfunction(behavior):
            async def stream(request, context):
                await self._check(context)
                async for item in behavior(request, context):
                    yield item
            return stream

        async def call(request, context):
            await self._check(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        return call
