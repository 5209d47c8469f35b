"""checkov policy CKV_TANDEM_1: the pod of every Tandem role says runAsNonRoot itself
(CKV_K8S_23 would also take a runAsUser > 0). Loaded by checkov (--external-checks-dir)."""
from checkov.common.models.enums import CheckCategories, CheckResult
from checkov.kubernetes.checks.resource.base_spec_check import BaseK8Check

ROLES = ("gateway", "verifier", "draft")


class TandemPodRunAsNonRoot(BaseK8Check):
    def __init__(self) -> None:
        super().__init__(name="Tandem pods set securityContext.runAsNonRoot", id="CKV_TANDEM_1",
                         categories=[CheckCategories.KUBERNETES],
                         supported_entities=["Deployment", "StatefulSet"])

    def scan_spec_conf(self, conf: dict) -> CheckResult:
        spec = ((conf.get("spec") or {}).get("template") or {}).get("spec") or {}
        if not any((c.get("args") or [None])[0] in ROLES for c in spec.get("containers") or []):
            return CheckResult.UNKNOWN  # not a Tandem role: CKV_K8S_23 alone
        context = spec.get("securityContext") or {}
        return CheckResult.PASSED if context.get("runAsNonRoot") is True else CheckResult.FAILED


check = TandemPodRunAsNonRoot()
