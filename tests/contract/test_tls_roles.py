"""Each mTLS role its own certificate, and servers check the caller's role (issue 47): a
draft worker's certificate, from the same CA, cannot call a verifier as a gateway, nor a
gateway's call a draft worker. Certificates are made with the openssl CLI as test_tls.py's."""
from __future__ import annotations

import asyncio
import secrets
import shutil
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_tls import _ca, _openssl, draft_server

from tandem.tls import TlsConfig, open_channel, tls_args, tls_from_args
from tandem.v1 import verify_pb2_grpc
from verify_service.config import VerifierConfig
from verify_service.main import _serve_grpc

pytestmark = pytest.mark.contract
SERVING = health_pb2.HealthCheckResponse.SERVING
DENIED = grpc.StatusCode.PERMISSION_DENIED
NAMES = {r: f"tandem-{r}.tandem.svc" for r in ("gateway", "verifier", "draft")}
EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _role_cert(d, role: str, ca) -> tuple[str, str]:
    """A role's certificate: its Service name (and loopback, to be served on it)."""
    (d / f"{role}.ext").write_text(f"subjectAltName=DNS:{NAMES[role]},DNS:localhost,"
                                   "IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", *EC, "-keyout", f"{role}.key", "-out", f"{role}.csr", "-subj",
             f"/CN={role}", cwd=d)
    _openssl("x509", "-req", "-in", f"{role}.csr", "-CA", ca[0], "-CAkey", ca[1],
             "-set_serial", str(secrets.randbits(62) + 1), "-days", "1", "-out",
             f"{role}.crt", "-extfile", f"{role}.ext", cwd=d)
    return str(d / f"{role}.crt"), str(d / f"{role}.key")


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates")
    d = tmp_path_factory.mktemp("roles")
    ca = _ca(d, "ca")
    return SimpleNamespace(ca=ca[0], **{r: _role_cert(d, r, ca) for r in NAMES})


def serving(roles, role: str, callers: tuple[str, ...]) -> TlsConfig:
    return TlsConfig(*getattr(roles, role), ca_file=roles.ca, require_client_cert=True,
                     client_names=tuple(NAMES[c] for c in callers))


def caller(roles, role: str) -> TlsConfig:
    return TlsConfig(*getattr(roles, role), ca_file=roles.ca)


async def check(address: str, tls: TlsConfig, watch: bool = False):
    """SERVING, or the status code the health Check (or the streaming Watch) failed with."""
    async with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            if watch:
                async for resp in stub.Watch(health_pb2.HealthCheckRequest(), timeout=5):
                    return resp.status
            return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_a_draft_worker_serves_verifiers_only(roles):
    async def main():
        async with draft_server(serving(roles, "draft", ("verifier",))) as address:
            assert await check(address, caller(roles, "verifier")) == SERVING
            assert await check(address, caller(roles, "verifier"), watch=True) == SERVING
            for other in ("gateway", "draft"):
                assert await check(address, caller(roles, other)) == DENIED
                assert await check(address, caller(roles, other), watch=True) == DENIED
    run(main())


def test_a_verifier_serves_gateways_only(roles):
    """The verifier's real server (_serve_grpc): a draft worker's certificate, signed by the
    same CA, is refused as a caller."""
    async def main():
        cfg = VerifierConfig(host="127.0.0.1", port=0,
                             tls=serving(roles, "verifier", ("gateway",)))
        model = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=256))
        server, _, port = await _serve_grpc(verify_pb2_grpc.VerifyServiceServicer(), cfg,
                                            model)
        try:
            address = f"127.0.0.1:{port}"
            assert await check(address, caller(roles, "gateway")) == SERVING
            assert await check(address, caller(roles, "draft")) == DENIED
            assert await check(address, caller(roles, "verifier")) == DENIED
        finally:
            await server.stop(None)
    run(main())


def test_client_names_flag_env_and_validation(roles, monkeypatch):
    from tools.cli import build_parser

    monkeypatch.setenv("TANDEM_TLS_CLIENT_NAMES", f"{NAMES['gateway']}, spiffe://x/gw")
    cert, key = roles.verifier
    args = build_parser().parse_args(["verifier", "--tls-cert", cert, "--tls-key", key,
                                      "--tls-ca", roles.ca, "--tls-client-auth"])
    cfg = tls_from_args(args)
    assert cfg.client_names == (NAMES["gateway"], "spiffe://x/gw")
    assert f"--tls-client-names={NAMES['gateway']},spiffe://x/gw" in tls_args(cfg)
    with pytest.raises(ValueError, match="needs --tls-client-auth"):
        TlsConfig(cert, key, roles.ca, client_names=(NAMES["gateway"],))
    with pytest.raises(ValueError, match="client_names"):
        TlsConfig(cert, key, roles.ca, require_client_cert=True, client_names=("a, b",))
