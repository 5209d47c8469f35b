"""Deploy tier: broken tensor-parallel overlays (on prod-gpu-multinode, the LeaderWorkerSet, and
prod-gpu-tp, the one-pod verifier) must be caught, each by its check (test_lws_manifests.py's or
test_manifests.py's); the unpatched controls must pass every check."""
from __future__ import annotations

import pytest
from test_lws_manifests import (
    LWS_CHECKS,
    MULTINODE,
    ONE_POD_TP,
    check_lws_network,
    check_lws_routing,
    check_lws_shape,
    check_tp_gpus,
)
from test_manifests import (
    all_problems,
    check_autoscalers,
    check_network_policies,
    check_readiness,
    check_schemas,
    render_broken,
)

pytestmark = pytest.mark.deploy

def _lws_patch(*ops: str) -> str:
    body = "".join(f"\n            {op}" for op in ops)
    return f"""
        - target: {{kind: LeaderWorkerSet, name: tandem-verifier-tp}}
          patch: |-{body}
        """


_LEADER = "/spec/leaderWorkerTemplate/leaderTemplate/spec"
_WORKER = "/spec/leaderWorkerTemplate/workerTemplate/spec"

BROKEN_LWS = {
    "control": (MULTINODE, None, None),
    "control-one-pod": (ONE_POD_TP, None, None),
    "no-startup-policy": (MULTINODE, check_lws_shape, _lws_patch(
        "- {op: remove, path: /spec/startupPolicy}")),
    "group-restart-policy-none": (MULTINODE, check_lws_shape, _lws_patch(
        "- {op: replace, path: /spec/leaderWorkerTemplate/restartPolicy, value: None}")),
    "hpa-targets-a-missing-lws": (MULTINODE, check_autoscalers, """
        - target: {kind: HorizontalPodAutoscaler, name: tandem-verifier}
          patch: |-
            - {op: replace, path: /spec/scaleTargetRef/name, value: tandem-verifier-gone}
        """),
    "hpa-targets-the-lws-as-a-deployment": (MULTINODE, check_autoscalers, """
        - target: {kind: HorizontalPodAutoscaler, name: tandem-verifier}
          patch: |-
            - {op: replace, path: /spec/scaleTargetRef/apiVersion, value: apps/v1}
        """),
    "unknown-field-in-a-template": (MULTINODE, check_schemas, _lws_patch(
        f"- {{op: add, path: {_WORKER}/containers/0/gpus, value: 4}}")),
    # (a worker without readiness or a memory limit: checkov, test_policies.py)
    "size-disagrees-with-tp": (MULTINODE, check_lws_shape, _lws_patch(
        "- {op: replace, path: /spec/leaderWorkerTemplate/size, value: 3}")),
    "worker-rank-not-from-the-index": (MULTINODE, check_lws_shape, _lws_patch(
        f"- {{op: replace, path: {_WORKER}/containers/0/args/3, value: --first-rank=4}}")),
    "worker-prestop-shorter-than-the-drain": (MULTINODE, check_lws_shape, _lws_patch(
        f"- {{op: replace, path: {_WORKER}/containers/0/lifecycle/preStop/exec/command, "
        "value: [sleep, '5']}")),
    "leader-readiness-on-grpc": (MULTINODE, check_readiness, _lws_patch(
        f"- {{op: replace, path: {_LEADER}/containers/0/readinessProbe/tcpSocket/port, "
        "value: 50051}")),
    "podmonitor-scrapes-workers": (MULTINODE, check_lws_routing, """
        - target: {kind: PodMonitor, name: tandem-verifier}
          patch: |-
            - op: replace
              path: /spec/selector
              value: {matchLabels: {leaderworkerset.sigs.k8s.io/name: tandem-verifier-tp}}
        """),
    "rank-range-over-grpc": (MULTINODE, check_network_policies, """
        - target: {kind: NetworkPolicy, name: tandem-verifier-ranks}
          patch: |-
            - {op: replace, path: /spec/ingress/0/ports/1/endPort, value: 60999}
            - {op: replace, path: /spec/egress/0/ports/1/endPort, value: 60999}
        """),
    "ranks-open-to-the-gateway": (MULTINODE, check_lws_network, """
        - target: {kind: NetworkPolicy, name: tandem-verifier-ranks}
          patch: |-
            - op: add
              path: /spec/ingress/0/from/-
              value: {podSelector: {matchLabels: {app.kubernetes.io/component: gateway}}}
        """),
    "one-pod-tp-on-too-few-gpus": (ONE_POD_TP, check_tp_gpus, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu
              value: 2
            - op: replace
              path: /spec/template/spec/containers/0/resources/requests/nvidia.com~1gpu
              value: 2
        """),
}


@pytest.mark.parametrize("case", list(BROKEN_LWS))
def test_broken_tp_overlay_is_caught(tmp_path, case):
    overlay, check, patches = BROKEN_LWS[case]
    docs = render_broken(tmp_path, overlay, patches)
    if check is None:
        problems = all_problems(docs) + [p for c in LWS_CHECKS for p in c(docs)]
        assert not problems, "the unpatched temp overlay must pass:\n" + "\n".join(problems)
        return
    assert check(docs), f"{check.__name__} missed the broken overlay ({case})"
