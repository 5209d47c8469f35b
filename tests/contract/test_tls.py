"""TLS and mTLS on the gRPC hops, on loopback with throwaway certificates.

A CA, a second (foreign) CA and leaf certificates for 127.0.0.1/localhost are made with the
`openssl` CLI at test time. The servers are real: an n-gram-only DraftService (no model
weights) and a fake VerifyService for the gateway's channel pool.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.config import DraftConfig
from draft_service.main import assemble_worker, build_app
from gateway.config import GatewayConfig
from gateway.verifier import ChannelPool
from tandem.proposers.ngram import NgramProposer
from tandem.spec import Method, Open, Proposal
from tandem.tls import TlsConfig, add_port, open_channel, tls_args, tls_from_args
from tandem.v1 import common_pb2, verify_pb2_grpc
from tools.launcher import grpc_healthy
from verify_service.config import VerifierConfig
from verify_service.drafts.link import DraftLink, DraftPool

pytestmark = pytest.mark.contract

SERVING = health_pb2.HealthCheckResponse.SERVING
REFUSED = grpc.StatusCode.UNAVAILABLE  # a failed handshake surfaces as UNAVAILABLE


# ---- certificates -----------------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _ca(d: Path, name: str) -> tuple[str, str]:
    _openssl("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt",
             "-days", "1", "-subj", f"/CN={name}", cwd=d)
    return str(d / f"{name}.crt"), str(d / f"{name}.key")


def _leaf(d: Path, name: str, ca: tuple[str, str]) -> tuple[str, str]:
    """A certificate for 127.0.0.1/localhost good for serving and as a client (as workers do)."""
    (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", ca[0], "-CAkey", ca[1],
             "-set_serial", str(secrets.randbits(62) + 1), "-days", "1",
             "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)
    return str(d / f"{name}.crt"), str(d / f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ca, foreign = _ca(d, "ca"), _ca(d, "foreign-ca")
    return SimpleNamespace(ca=ca[0], foreign_ca=foreign[0], server=_leaf(d, "server", ca),
                           client=_leaf(d, "client", ca),
                           foreign_client=_leaf(d, "intruder", foreign), dir=d)


def server_tls(pki, mtls: bool) -> TlsConfig:
    return TlsConfig(*pki.server, ca_file=pki.ca, require_client_cert=mtls)


def client_tls(pki, cert=None, ca=None, server_name="") -> TlsConfig:
    cert_file, key_file = cert or ("", "")
    return TlsConfig(cert_file, key_file, ca or pki.ca, server_name=server_name)


# ---- servers and probes -----------------------------------------------------------------------

@contextlib.asynccontextmanager
async def draft_server(tls: TlsConfig | None):
    """A real DraftService (n-gram only: no weights) on 127.0.0.1:0; yields its address."""
    cfg = DraftConfig(host="127.0.0.1", port=0, model=None, drain_grace_s=0.0, tls=tls)
    worker, info = assemble_worker(cfg, {Method.NGRAM: NgramProposer(3, 8)}, "ngram", "",
                                   1000, 4096)
    app = await build_app(cfg, worker, info)
    await app.server.start()
    try:
        yield f"127.0.0.1:{app.port}"
    finally:
        await app.server.stop(None)
        await app.worker.aclose()


async def health(address: str, tls: TlsConfig | None):
    """SERVING, or the status code the Check failed with."""
    async with open_channel(address, tls) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return resp.status


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


# ---- the transport ----------------------------------------------------------------------------

def test_tls_clients_verify_the_server_against_the_ca(pki):
    async def main():
        async with draft_server(server_tls(pki, mtls=False)) as address:
            assert await health(address, client_tls(pki)) == SERVING
            # a client certificate is accepted where none is required
            assert await health(address, client_tls(pki, cert=pki.client)) == SERVING
            assert await health(address, None) == REFUSED  # plaintext
            assert await health(address, client_tls(pki, ca=pki.foreign_ca)) == REFUSED
            # --tls-server-name: dialled by IP, checked against a name the certificate holds
            assert await health(address, client_tls(pki, server_name="localhost")) == SERVING
            assert await health(address, client_tls(pki, server_name="evil.example")) == REFUSED
    run(main())


def test_mtls_needs_a_client_certificate_from_the_ca(pki):
    async def main():
        async with draft_server(server_tls(pki, mtls=True)) as address:
            assert await health(address, client_tls(pki, cert=pki.client)) == SERVING
            assert await health(address, client_tls(pki)) == REFUSED  # no certificate
            assert await health(address, client_tls(pki, cert=pki.foreign_client)) == REFUSED
            assert await health(address, None) == REFUSED
            # the worker's own serving certificate doubles as its client certificate
            assert await health(address, client_tls(pki, cert=pki.server)) == SERVING
    run(main())


def test_plaintext_stays_the_default(pki):
    async def main():
        async with draft_server(None) as address:
            assert await health(address, None) == SERVING
            assert await health(address, client_tls(pki)) == REFUSED
    run(main())


# ---- the hops: verifier -> draft, gateway -> verifier, launcher checks ----------------------

def test_draft_link_speaks_mtls(pki):
    replies: list = []
    link_tls = server_tls(pki, mtls=True)  # a verifier presents the certificate it serves

    async def main():
        async with draft_server(link_tls) as remote:
            link = DraftLink(remote, lambda _link, r: replies.append(r), lambda _link: None,
                             tls=link_tls)
            assert await link.start()
            link.send(Open("s1", [5, 6, 7, 5, 6], method=Method.NGRAM, max_run_ahead=2))
            for _ in range(100):
                if replies:
                    break
                await asyncio.sleep(0.05)
            await link.close()
            plain = DraftLink(remote, lambda *_: None, lambda *_: None)
            assert not await plain.start(connect_timeout_s=0.5)
            await plain.close()

            pool = DraftPool([remote], None, lambda *_: None, lambda *_: None, tls=link_tls)
            pooled = await pool.get()
            assert pooled.address == remote and pooled.alive and pooled.tls is link_tls
            await pool.close()
    run(main())
    assert replies and isinstance(replies[0], Proposal) and replies[0].session_id == "s1"
    assert replies[0].token.token_id == 7  # the n-gram continuation, over the mTLS stream


class InfoOnly(verify_pb2_grpc.VerifyServiceServicer):
    async def Info(self, request, context):
        return common_pb2.WorkerInfo(model_id="tls-verifier", max_sessions=7)


def test_gateway_channel_pool_dials_verifiers_with_its_certificate(pki):
    async def main():
        server = grpc.aio.server()
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(InfoOnly(), server)
        port = add_port(server, "127.0.0.1:0", server_tls(pki, mtls=True))
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            pool = ChannelPool(GatewayConfig(tls=client_tls(pki, cert=pki.client)))
            rec = await pool.describe_verifier(address)
            assert (rec.model_id, rec.capacity) == ("tls-verifier", 7)
            await pool.close()
            plain = ChannelPool(GatewayConfig(info_timeout_s=1.0))
            assert (await plain.describe_verifier(address)).model_id == ""  # refused
            await plain.close()
        finally:
            await server.stop(None)
    run(main())


def test_launcher_health_check_over_mtls(pki):
    async def main():
        async with draft_server(server_tls(pki, mtls=True)) as address:
            ok = await asyncio.to_thread(grpc_healthy, address, 5.0, server_tls(pki, True))
            plain = await asyncio.to_thread(grpc_healthy, address, 5.0)
            assert (ok, plain) == (True, False)
    run(main())


# ---- configuration: flags, env and validation -------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    from tools.cli import build_parser

    return build_parser()


def test_flags_and_env_build_the_config(pki, monkeypatch):
    for name in ("CERT", "KEY", "CA", "CLIENT_AUTH", "SERVER_NAME"):
        monkeypatch.delenv(f"TANDEM_TLS_{name}", raising=False)
    cert, key = pki.server
    args = _parser().parse_args(["draft", "--tls-cert", cert, "--tls-key", key,
                                 "--tls-ca", pki.ca, "--tls-client-auth"])
    want = TlsConfig(cert, key, pki.ca, require_client_cert=True)
    assert tls_from_args(args) == want
    assert tls_from_args(_parser().parse_args(["verifier"])) is None  # default: plaintext
    assert tls_from_args(_parser().parse_args(["verifier", *tls_args(want)])) == want
    monkeypatch.setenv("TANDEM_TLS_CERT", cert)
    monkeypatch.setenv("TANDEM_TLS_KEY", key)
    monkeypatch.setenv("TANDEM_TLS_CA", pki.ca)
    monkeypatch.setenv("TANDEM_TLS_CLIENT_AUTH", "true")
    monkeypatch.setenv("TANDEM_TLS_SERVER_NAME", "tandem-verifier.tandem.svc")
    for role in ("verifier", "draft", "up"):
        got = tls_from_args(_parser().parse_args([role]))
        assert got == TlsConfig(cert, key, pki.ca, True, "tandem-verifier.tandem.svc"), role
    gateway = tls_from_args(_parser().parse_args(["gateway"]))
    assert gateway.cert_file == cert and not gateway.require_client_cert  # a client only
    with pytest.raises(SystemExit):
        _parser().parse_args(["gateway", "--tls-client-auth"])
    monkeypatch.setenv("TANDEM_TLS_CLIENT_AUTH", "maybe")
    with pytest.raises(SystemExit):  # argparse's usage error, as for any bad flag
        _parser().parse_args(["draft"])


def _bad_configs(pki) -> dict[str, tuple[dict, str]]:
    cert, key = pki.server
    (pki.dir / "junk.pem").write_text("not a certificate\n")
    return {
        "key without cert": ({"key_file": key, "ca_file": pki.ca}, "--tls-cert and --tls-key"),
        "cert without key": ({"cert_file": cert}, "--tls-cert and --tls-key"),
        "nothing": ({}, "needs a certificate"),
        "mtls without ca": ({"cert_file": cert, "key_file": key,
                             "require_client_cert": True}, "needs --tls-ca"),
        "missing file": ({"ca_file": str(pki.dir / "absent.crt")}, "cannot be read"),
        "directory": ({"ca_file": str(pki.dir)}, "cannot be read"),
        "swapped": ({"cert_file": key, "key_file": cert}, "holds no PEM certificate"),
        "not pem": ({"ca_file": str(pki.dir / "junk.pem")}, "holds no PEM CA"),
        "server name": ({"ca_file": pki.ca, "server_name": "host:1"}, "host name"),
        "bool": ({"ca_file": pki.ca, "require_client_cert": "yes"}, "must be a bool"),
    }


def test_tls_config_validation(pki):
    for case, (kwargs, message) in _bad_configs(pki).items():
        with pytest.raises(ValueError, match=message):
            TlsConfig(**kwargs)
            pytest.fail(f"{case} was accepted")
    client_only = client_tls(pki)
    with pytest.raises(ValueError, match="certificate and key"):
        DraftConfig(tls=client_only)  # a server must have something to serve with
    with pytest.raises(ValueError, match="certificate and key"):
        VerifierConfig(tls=client_only)
    with pytest.raises(ValueError, match="TlsConfig"):
        GatewayConfig(tls="/etc/tandem/tls")
    assert GatewayConfig(tls=client_only).tls is client_only
    assert DraftConfig(tls=server_tls(pki, True)).tls.require_client_cert
