"""Deploy tier: the standard Kubernetes and Dockerfile policies, through checkov.

Every render test_manifests.py checks (a LeaderWorkerSet's two pod templates written as
Deployments, so the container checks see them) and both Dockerfiles go through one checkov run
with the checks below, plus Tandem's own checkov policies in tests/deploy/policies/. Broken
renders must be caught by the check named for them. What no policy tool knows (ports that agree
with the `tandem` flags, the autoscalers' metrics, drain and grace times, ...) stays in
test_manifests.py.

checkov lives in its own virtualenv (`make venv` builds .venv/checkov: its pins would
downgrade packages the project needs); TANDEM_CHECKOV names another. Offline
(--skip-download); one run, a few seconds.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_lws_broken import _WORKER, _lws_patch
from test_lws_manifests import MULTINODE
from test_manifests import DEPLOY, LWS_API, TARGETS, lws_views, render, render_dir, write_overlay

pytestmark = pytest.mark.deploy

HERE = Path(__file__).resolve().parent
K8S_CHECKS = {  # checkov's check -> what test_manifests.py checked by hand before
    "CKV_K8S_8": "every container has a livenessProbe",
    "CKV_K8S_9": "every container has a readinessProbe",
    "CKV_K8S_10": "CPU requests on every container (init containers too)",
    "CKV_K8S_11": "CPU limits on every container",
    "CKV_K8S_12": "memory requests on every container",
    "CKV_K8S_13": "memory limits on every container",
    "CKV_K8S_14": "images carry a pinned tag (not latest, not blank) or a digest",
    "CKV_K8S_20": "allowPrivilegeEscalation: false",
    "CKV_K8S_23": "no root containers",
    "CKV_TANDEM_1": "a Tandem role's pod sets runAsNonRoot (policies/)",
}
DOCKER_CHECKS = {"CKV_DOCKER_3": "the image creates a user", "CKV_DOCKER_8": "the last USER "
                 "is not root"}
UNMAPPED = {("base", "CKV_K8S_14")}  # the base leaves images to the overlays (logical names)
BROKEN = {  # case -> (overlay, patches, the checks that must fail, the resource they name)
    "no-readiness-probe": ("dev", """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: remove
              path: /spec/template/spec/containers/0/readinessProbe
        """, ("CKV_K8S_9",), "tandem-verifier"),
    "no-memory-limit": ("dev", """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: remove
              path: /spec/template/spec/containers/0/resources/limits/memory
        """, ("CKV_K8S_13",), "tandem-gateway"),
    "privilege-escalation": ("dev", """
        - target: {kind: Deployment, name: tandem-draft}
          patch: |-
            - op: add
              path: /spec/template/spec/containers/0/securityContext/allowPrivilegeEscalation
              value: true
        """, ("CKV_K8S_20",), "tandem-draft"),
    "pod-may-run-as-root": ("dev", """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: remove
              path: /spec/template/spec/securityContext/runAsNonRoot
        """, ("CKV_TANDEM_1",), "tandem-gateway"),
    "latest-image": ("prod-gpu", """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/image
              value: ghcr.io/example/tandem:latest
        """, ("CKV_K8S_14",), "tandem-gateway"),
    "lws-worker-without-readiness-or-memory-limit": (MULTINODE, _lws_patch(
        f"- {{op: remove, path: {_WORKER}/containers/0/readinessProbe}}",
        f"- {{op: remove, path: {_WORKER}/containers/0/resources/limits/memory}}"),
        ("CKV_K8S_9", "CKV_K8S_13"), "tandem-verifier-tp-worker"),
}


def checkov_binary() -> str:
    venv = Path(os.environ.get("VIRTUAL_ENV") or HERE.parents[1] / ".venv")
    for candidate in (os.environ.get("TANDEM_CHECKOV"), venv / "checkov" / "bin" / "checkov",
                      shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("checkov is not installed: `make venv` builds .venv/checkov")


def as_checkov_input(docs: list[dict]) -> list[dict]:
    """The render, each LeaderWorkerSet as a Deployment per pod template (leader, worker)."""
    out = []
    for d in docs:
        if d.get("kind") == "LeaderWorkerSet" and d.get("apiVersion") == LWS_API:
            for view in lws_views(d):
                meta = {**d["metadata"], "name": f"{d['metadata']['name']}-{view['lwsPart']}"}
                out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                            "spec": {"template": view["spec"]["template"]}})
        else:
            out.append(d)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, dict[str, list[str]]]]:
    """file stem -> check id -> {"passed": [resources], "failed": [resources]}."""
    where = tmp_path_factory.mktemp("checkov")
    scan = where / "scan"
    scan.mkdir()
    for target in TARGETS:
        (scan / f"{target}.yaml").write_text(yaml.safe_dump_all(as_checkov_input(render(target))))
    for case, (overlay, patches, _, _) in BROKEN.items():
        docs = render_dir(write_overlay(where / case, overlay, patches))
        (scan / f"broken-{case}.yaml").write_text(yaml.safe_dump_all(as_checkov_input(docs)))
    for flavor in ("cpu", "cuda"):
        shutil.copy(DEPLOY / "docker" / f"Dockerfile.{flavor}", scan / f"Dockerfile.{flavor}")
    proc = subprocess.run(
        [checkov_binary(), "-d", str(scan), "--framework", "kubernetes", "dockerfile",
         "--skip-download", "-o", "json", "--external-checks-dir",
         str(HERE / "policies"), "--check", ",".join([*K8S_CHECKS, *DOCKER_CHECKS])],
        capture_output=True, text=True, timeout=300, check=False)
    reports = json.loads(proc.stdout)
    out: dict = {}
    for report in reports if isinstance(reports, list) else [reports]:
        for outcome in ("passed", "failed"):
            for r in report["results"].get(f"{outcome}_checks", []):
                stem = Path(r["file_path"]).name.removesuffix(".yaml")
                by_check = out.setdefault(stem, {}).setdefault(r["check_id"], {})
                by_check.setdefault(outcome, []).append(r["resource"])
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_every_render_passes_the_standard_policies(results, target):
    got = results[target]
    failed = {c: r["failed"] for c, r in got.items() if r.get("failed")
              and (target, c) not in UNMAPPED}
    assert not failed, failed
    ran = {c for c, r in got.items() if r.get("passed")}
    missing = set(K8S_CHECKS) - ran - {c for t, c in UNMAPPED if t == target}
    assert not missing, f"checks that saw nothing to pass in {target}: {missing}"


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_dockerfiles_pass_the_standard_policies(results, flavor):
    got = results[f"Dockerfile.{flavor}"]
    assert {c for c, r in got.items() if r.get("passed") and not r.get("failed")} == \
        set(DOCKER_CHECKS), got


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_manifest_is_caught_by_a_policy(results, case):
    _, _, checks, resource = BROKEN[case]
    for check in checks:
        failed = results[f"broken-{case}"].get(check, {}).get("failed", [])
        assert any(resource in r for r in failed), (check, results[f"broken-{case}"])
