"""Deploy tier, TLS: the prod overlays run gRPC over mutual TLS, each role from its own Secret
tandem-tls-ROLE (issue 47: one certificate no longer serves every role).

Checks the rendered manifests (components/tls): the role's Secret mounted read-only in every
Tandem pod, TANDEM_TLS_* naming its cert-manager keys, mTLS on both worker pools that admits
the calling role only (TANDEM_TLS_CLIENT_NAMES: the caller's Service name), the names clients
verify matching the Services of the render, and probes a kubelet can run against a TLS port.
The env is then fed to the real CLI, which must build a TlsConfig from it. Dev and the base
stay plaintext. Broken overlays must be caught. Reuses test_manifests.py's rendering.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_manifests import (
    OVERLAYS,
    WORKER_ROLES,
    container_env,
    name_of,
    namespace_of,
    pod_spec,
    probed_port,
    render,
    render_broken,
    resolve_port,
    services_selecting,
    tandem_containers,
)

pytestmark = pytest.mark.deploy

SECRETS = {role: f"tandem-tls-{role}" for role in ("gateway", "verifier", "draft")}
MOUNT = "/etc/tandem/tls"
# TANDEM_TLS_* -> the cert-manager Secret key it must name
FILES = {"TANDEM_TLS_CERT": "tls.crt", "TANDEM_TLS_KEY": "tls.key", "TANDEM_TLS_CA": "ca.crt"}
# who dials whom: the client role -> the Service of the role it dials
DIALS = {"gateway": "verifier", "verifier": "draft"}
CALLERS = {server: client for client, server in DIALS.items()}  # the one role that may call
PROD = [o for o in OVERLAYS if o.startswith("prod-")]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _secret_mount(dep, container, role) -> list[str]:
    """Problems with the role's TLS volume and its mount in one container."""
    volumes = [v for v in pod_spec(dep).get("volumes", [])
               if (v.get("secret") or {}).get("secretName") in SECRETS.values()]
    names = [v["secret"]["secretName"] for v in volumes]
    if names != [SECRETS[role]]:
        return [f"{name_of(dep)}: TLS Secrets {names}, want its role's own, {SECRETS[role]}"]
    secret = volumes[0]["secret"]
    problems = []
    if secret.get("optional"):
        problems.append(f"{name_of(dep)}: the TLS Secret must not be optional")
    keys = {i["key"] for i in secret.get("items") or []}
    if keys and not set(FILES.values()) <= keys:
        problems.append(f"{name_of(dep)}: Secret items {sorted(keys)} miss a TLS key")
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] == volumes[0]["name"]]
    if [(m["mountPath"], m.get("readOnly")) for m in mounts] != [(MOUNT, True)]:
        problems.append(f"{name_of(dep)}: mount {names[0]} once, read-only, at {MOUNT}")
    return problems


def _service_names(docs, role) -> set[str]:
    """The FQDNs of the Services of `role`'s pods: what its certificate names."""
    peers = [d for d, _c, r in tandem_containers(docs) if r == role]
    return {f"{s['metadata']['name']}.{namespace_of(s)}.svc"
            for peer in peers for s in services_selecting(docs, peer)}


def _client_names(docs, dep, role, env) -> list[str]:
    """A worker admits the certificate of the one role that calls it, no other."""
    got = {n.strip() for n in env.get("TANDEM_TLS_CLIENT_NAMES", "").split(",") if n.strip()}
    want = _service_names(docs, CALLERS[role])
    if not got or not got <= want:
        return [f"{name_of(dep)}: TANDEM_TLS_CLIENT_NAMES {sorted(got)} must name the "
                f"{CALLERS[role]} only: some of {sorted(want)}"]
    return []


def _server_name(docs, dep, role, env) -> list[str]:
    """The name a client verifies must be the FQDN of the Service it dials, in this render."""
    if role not in DIALS:
        return []
    want = _service_names(docs, DIALS[role])
    got = env.get("TANDEM_TLS_SERVER_NAME")
    if got not in want:
        return [f"{name_of(dep)}: TANDEM_TLS_SERVER_NAME {got!r} is not one of {sorted(want)}"]
    return []


def check_tls(docs) -> list[str]:
    """Every Tandem pod on mTLS from the mounted Secret; [] when the render is right."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        problems += _secret_mount(dep, c, role)
        env = container_env(c, docs, namespace_of(dep))
        for var, key in FILES.items():
            if env.get(var) != f"{MOUNT}/{key}":
                problems.append(f"{name_of(dep)}: {var}={env.get(var)!r}, want {MOUNT}/{key}")
        problems += _server_name(docs, dep, role, env)
        if role not in WORKER_ROLES:
            continue
        if env.get("TANDEM_TLS_CLIENT_AUTH", "").lower() not in ("true", "1", "yes", "on"):
            problems.append(f"{name_of(dep)}: a worker must require client certificates")
        problems += _client_names(docs, dep, role, env)
        port = probed_port(dep, c)  # the gRPC port (an LWS leader: the rendezvous port)
        for probe in PROBES:
            handler = c.get(probe) or {}
            if "grpc" in handler:  # kubelet gRPC probes speak plaintext only
                problems.append(f"{name_of(dep)}: {probe} is a gRPC probe on a TLS port")
            elif resolve_port((handler.get("tcpSocket") or {}).get("port"), c) != port:
                problems.append(f"{name_of(dep)}: {probe} must check the TLS port {port}")
    return problems


@pytest.mark.parametrize("overlay", PROD)
def test_prod_runs_mtls_from_the_mounted_secret(overlay):
    docs = render(overlay)
    assert check_tls(docs) == []
    roles = {r for _d, _c, r in tandem_containers(docs)}
    assert roles == {"gateway", "verifier", "draft"}


@pytest.mark.parametrize("target", ["base", *[o for o in OVERLAYS if o not in PROD]])
def test_other_renders_stay_plaintext(target):
    docs = render(target)
    for dep, c, _role in tandem_containers(docs):
        env = container_env(c, docs, namespace_of(dep))
        assert not [k for k in env if k.startswith("TANDEM_TLS_")], name_of(dep)
        assert not any((v.get("secret") or {}).get("secretName") in SECRETS.values()
                       for v in pod_spec(dep).get("volumes", [])), name_of(dep)


def _pem_files(tmp_path: Path) -> Path:
    """Stand-ins for the Secret's files: the CLI checks they hold PEM blocks of the right kind."""
    cert = "-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n"
    (tmp_path / "tls.crt").write_text(cert)
    (tmp_path / "ca.crt").write_text(cert)
    (tmp_path / "tls.key").write_text("-----BEGIN PRIVATE KEY-----\nMA==\n"
                                      "-----END PRIVATE KEY-----\n")
    return tmp_path


@pytest.mark.parametrize("overlay", PROD)
def test_the_cli_builds_mtls_from_the_pods_env(overlay, tmp_path, monkeypatch):
    from tandem.tls import tls_from_args
    from tools.cli import build_parser

    files = _pem_files(tmp_path)
    docs = render(overlay)
    for dep, c, role in tandem_containers(docs):
        env = container_env(c, docs, namespace_of(dep))
        for key in [k for k in env if k.startswith("TANDEM_TLS_")] + list(FILES):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            if key.startswith("TANDEM_TLS_"):
                monkeypatch.setenv(key, value.replace(MOUNT, str(files)))
        args = [re.sub(r"\$\(\w+\)", "x", a) for a in c["args"]]
        tls = tls_from_args(build_parser().parse_known_args(args)[0])
        assert tls is not None, name_of(dep)
        assert tls.cert_file == str(files / "tls.crt") and tls.ca_file == str(files / "ca.crt")
        assert tls.require_client_cert == (role in WORKER_ROLES), name_of(dep)
        if role in WORKER_ROLES:
            assert tls.can_serve and tls.client_names, name_of(dep)



def _patch(deployment: str, container: str, body: str) -> str:
    """A strategic merge patch on one container (merged by name, so no list indexes)."""
    return f"""
        - patch: |-
            apiVersion: apps/v1
            kind: Deployment
            metadata: {{name: {deployment}}}
            spec:
              template:
                spec:
                  containers:
                    - name: {container}
{body}"""


BROKEN = {
    "mount-dropped": _patch("tandem-draft", "draft", """\
                      volumeMounts:
                        - {mountPath: /etc/tandem/tls, $patch: delete}"""),
    "grpc-probe-back": _patch("tandem-verifier", "verifier", """\
                      readinessProbe: {grpc: {port: 50051}, tcpSocket: null}"""),
    "no-client-auth": _patch("tandem-draft", "draft", """\
                      env:
                        - {name: TANDEM_TLS_CLIENT_AUTH, value: "false"}"""),
    "wrong-server-name": _patch("tandem-gateway", "gateway", """\
                      env:
                        - {name: TANDEM_TLS_SERVER_NAME, value: tandem-draft.tandem.svc}"""),
    "shared-certificate": """
        - patch: |-
            apiVersion: apps/v1
            kind: Deployment
            metadata: {name: tandem-draft}
            spec:
              template:
                spec:
                  volumes:
                    - {name: tls, secret: {secretName: tandem-tls-verifier}}""",
    "no-client-names": _patch("tandem-verifier", "verifier", """\
                      env:
                        - {name: TANDEM_TLS_CLIENT_NAMES, $patch: delete}"""),
    "drafts-call-verifiers": _patch("tandem-verifier", "verifier", """\
                      env:
                        - {name: TANDEM_TLS_CLIENT_NAMES, value: tandem-draft.tandem.svc}"""),
    "cert-elsewhere": _patch("tandem-verifier", "verifier", """\
                      env:
                        - {name: TANDEM_TLS_CERT, value: /etc/tls/tls.crt}"""),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_tls_is_caught(tmp_path, case):
    docs = render_broken(tmp_path, "prod-gpu", BROKEN[case])
    assert check_tls(docs), f"check_tls missed {case}"
