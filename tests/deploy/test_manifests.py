"""Deploy tier: render every kustomize overlay and check it offline.

Each overlay under deploy/k8s/overlays (and the base) is rendered with `kubectl kustomize`, and
every document is validated against the Kubernetes OpenAPI JSON schemas bundled in the
`kubernetes-validate` package (strict: unknown fields fail) for one Kubernetes version. CRDs the
bundle does not know (KEDA's ScaledObject) get a structural schema of our own that reuses the
bundled definitions where it can (the HPA behavior block).

The standard policies (probes, cpu/memory requests and limits, non-root, no privilege
escalation, pinned image tags, the Dockerfiles' USER) are checkov's: test_policies.py.
Here, Tandem's own invariants, each saying why no policy tool covers it: probe ports that
resolve and requests within limits, ports that agree
between the `tandem` flags, containerPorts, probes and Services (the gateway's /metrics port kept
off its public Service), headless worker Services, autoscalers that target existing Deployments
on the metrics the workers export (and own their replica count), node classes that keep drafts
and verifiers on different GPU types (the gateway on the CPU image), NetworkPolicies that let
only the gateway reach verifiers and only verifiers reach drafts, termination grace longer than
the drain (the gateway's longer than a request), readiness that follows the drain, secrets only
from Secrets, a durable authenticated Redis in production, dual-stack addresses, zone spreading,
one log level, and the OpenTelemetry wiring. Negative tests render deliberately broken overlays
and require the checks to catch them. A LeaderWorkerSet (the multi-node tensor-parallel
verifier) counts as two workloads, its leader and worker pod templates (lws_views);
test_lws_manifests.py checks what only such a verifier needs.

Needs `kubectl` (skipped cleanly without it) and the dev extra (kubernetes-validate, PyYAML).
Offline; a few seconds.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Callable, Iterable
from fractions import Fraction
from functools import cache
from importlib.resources import files as _resource_files
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

try:
    import jsonschema
    import kubernetes_validate
    from referencing import Registry, Resource
except ImportError as exc:  # pragma: no cover - a clear message instead of a bare traceback
    raise ImportError(
        "the deploy tests need kubernetes-validate (and PyYAML): pip install -e '.[dev]'"
    ) from exc

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUBE_VERSION = "1.30.0"  # the Kubernetes version whose schemas the manifests must satisfy
KUBECTL = shutil.which("kubectl")

ROLES = ("gateway", "verifier", "draft")
WORKER_ROLES = ("verifier", "draft")
# What the autoscalers may read, per role (the gauges the processes export).
ROLE_METRICS = {
    "verifier": {"tandem_verifier_waiting_sessions", "tandem_verifier_running_sessions",
                 "tandem_verifier_kv_cache_usage_ratio"},
    "draft": {"tandem_draft_queue_depth", "tandem_draft_sessions"},
    "gateway": {"tandem_gateway_requests_in_flight"},
}
ALLOWED_METRICS = set().union(*ROLE_METRICS.values())
# Metrics each pool's autoscaler must use (what the brief's scaling policy is built on).
REQUIRED_METRICS = {
    "verifier": {"tandem_verifier_waiting_sessions", "tandem_verifier_kv_cache_usage_ratio"},
    "draft": {"tandem_draft_queue_depth"},
}
DEFAULT_DRAIN_GRACE_S = 5.0  # `tandem verifier|draft --drain-grace-s` default
REGISTRY_LEAVE_S = 5.0  # a worker waits up to this long to leave the Redis registry first
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # GatewayConfig.request_timeout_s (a test pins the two)
GPU = "nvidia.com/gpu"
GPU_CLASS_LABEL = "tandem.dev/gpu-class"
DUAL_STACK_HOST = "::"  # what every tandem process binds (IPv4 and IPv6)
# The worker's gRPC service names: readiness asks for these (NOT_SERVING while draining).
HEALTH_SERVICES = {"verifier": "tandem.v1.VerifyService", "draft": "tandem.v1.DraftService"}
REDIS_SECRET = "tandem-redis"  # key `password` (REDIS_PASSWORD); `url` with external-redis
API_KEYS_SECRET = "tandem-api-keys"  # key `keys`: the gateway's TANDEM_API_KEYS_FILE
# Logical image names in the base, which every overlay maps (kustomize images:).
LOGICAL_IMAGES = {"gateway": "tandem-gateway-image", "verifier": "tandem-worker-image",
                  "draft": "tandem-worker-image"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# A verifier bigger than a node is a LeaderWorkerSet (overlays/prod-gpu-multinode): the checks
# see each of its pod templates as a workload of its own (lws_views).
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_LABEL = "leaderworkerset.sigs.k8s.io/"  # the labels its controller puts on every pod
SCALABLE_KINDS = ("Deployment", "LeaderWorkerSet")  # what an autoscaler may target

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir()
                  if (p / "kustomization.yaml").is_file())
# Renders of an overlay plus documented components that no overlay includes.
VARIANTS = {"prod-gpu+external-redis": ("prod-gpu", ("external-redis",))}
TARGETS = ["base", *OVERLAYS, *VARIANTS]  # every render the tier checks
PROD_TARGETS = [t for t in TARGETS if t.startswith("prod-")]

Doc = dict[str, Any]


# --------------------------------------------------------------------------------- rendering

def _require_kubectl() -> str:
    if KUBECTL is None:
        pytest.skip("kubectl is not on PATH: the deploy tier renders the overlays with "
                    "`kubectl kustomize` (install kubectl to run it)")
    return KUBECTL


def render_dir(path: Path) -> list[Doc]:
    """`kubectl kustomize PATH` as a list of documents."""
    proc = subprocess.run([_require_kubectl(), "kustomize", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def target_dir(target: str) -> Path:
    return K8S / "base" if target == "base" else K8S / "overlays" / target


def write_overlay(where: Path, base_overlay: str, patches: str | None = None,
                  components: Iterable[str] = ()) -> Path:
    """A kustomization in `where` on top of an overlay, with patches and components."""
    where.mkdir(parents=True, exist_ok=True)

    def rel(path: Path) -> str:  # kustomize wants relative paths
        return os.path.relpath(path, where)
    text = f"resources:\n  - {rel(K8S / 'overlays' / base_overlay)}\n"
    if components:
        text += "components:\n" + "".join(f"  - {rel(K8S / 'components' / c)}\n"
                                           for c in components)
    if patches:
        text += "patches:\n" + textwrap.indent(textwrap.dedent(patches).strip("\n"), "  ") + "\n"
    (where / "kustomization.yaml").write_text(text)
    return where


@cache
def _render_cached(target: str) -> tuple[str, ...]:
    # cached as JSON text so every test gets its own copy to inspect
    if target in VARIANTS:
        base_overlay, components = VARIANTS[target]
        with tempfile.TemporaryDirectory() as tmp:
            docs = render_dir(write_overlay(Path(tmp) / "variant", base_overlay,
                                            components=components))
    else:
        docs = render_dir(target_dir(target))
    return tuple(json.dumps(d) for d in docs)


def render(target: str) -> list[Doc]:
    return [json.loads(d) for d in _render_cached(target)]


@pytest.fixture(params=TARGETS)
def target(request) -> str:
    return request.param


@pytest.fixture
def docs(target) -> list[Doc]:
    return render(target)


# ----------------------------------------------------------------------------------- helpers

def name_of(doc: Doc) -> str:
    part = f" ({doc['lwsPart']}Template)" if "lwsPart" in doc else ""
    return f"{doc['kind']}/{doc['metadata']['name']}{part}"


def of_kind(docs: Iterable[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def find(docs: Iterable[Doc], kind: str, name: str) -> Doc | None:
    return next((d for d in docs if d.get("kind") == kind and d["metadata"]["name"] == name),
                None)


def workloads(docs: Iterable[Doc]) -> list[Doc]:
    """Deployments and StatefulSets (the in-cluster Redis is a StatefulSet in production), and
    each LeaderWorkerSet's two pod templates (lws_views)."""
    out = []
    for d in docs:
        if d.get("kind") in WORKLOAD_KINDS:
            out.append(d)
        elif d.get("kind") == "LeaderWorkerSet" and d.get("apiVersion") == LWS_API:
            out += lws_views(d)
    return out


def lws_views(lws: Doc) -> list[Doc]:
    """A LeaderWorkerSet's leader and worker pod templates, each shaped as a Deployment
    (`spec.template`) whose pods carry the labels the LWS controller adds: the set's name and
    the worker index (0: the leader; 1: stands for every worker). `lwsPart` says which and
    `lws` is the set itself. A missing template is the other one, as in the API."""
    lwt = (lws.get("spec") or {}).get("leaderWorkerTemplate") or {}
    worker = lwt.get("workerTemplate") or {}
    views = []
    for part, template, index in (("leader", lwt.get("leaderTemplate") or worker, "0"),
                                  ("worker", worker, "1")):
        template = json.loads(json.dumps(template))
        labels = template.setdefault("metadata", {}).setdefault("labels", {})
        labels.update({LWS_LABEL + "name": lws["metadata"]["name"],
                       LWS_LABEL + "worker-index": index, LWS_LABEL + "group-index": "0"})
        template.setdefault("spec", {}).setdefault("containers", [])
        views.append({"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
                      "metadata": lws["metadata"], "spec": {"template": template},
                      "lwsPart": part, "lws": lws})
    return views


def probed_port(dep: Doc, container: Doc) -> int | None:
    """The port a tandem worker's probes check: its gRPC --port; for a LeaderWorkerSet's
    leader under startupPolicy LeaderReady, rank 0's rendezvous port instead (the set creates
    the workers only once the leader is Ready, and the gRPC port opens only after every rank
    joined: a probe on it would wait for workers that wait for it)."""
    flags = parse_flags((container.get("args") or [])[1:])
    if dep.get("lwsPart") == "leader" and \
            dep["lws"]["spec"].get("startupPolicy") == "LeaderReady":
        master = flags.get("tensor-parallel-master", "")
        port = master.rpartition(":")[2]
        return int(port) if port.isdigit() else None
    return int(flags["port"]) if flags.get("port", "").isdigit() else None


def pod_spec(deploy: Doc) -> Doc:
    return deploy["spec"]["template"]["spec"]


def pod_labels(deploy: Doc) -> dict[str, str]:
    return deploy["spec"]["template"]["metadata"].get("labels", {})


def namespace_of(doc: Doc) -> str:
    return doc["metadata"].get("namespace", "default")


def parse_flags(args: list[str]) -> dict[str, str]:
    """`--flag=value` and `--flag value` (the last occurrence wins); bare flags map to ''."""
    flags: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg[2:].split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                key, value = arg[2:], args[i + 1]
                i += 1
            else:
                key, value = arg[2:], ""
            flags[key] = value
        i += 1
    return flags


def tandem_containers(docs: Iterable[Doc]) -> list[tuple[Doc, Doc, str]]:
    """(deployment, container, role) for every container running `tandem <role>`."""
    out = []
    for dep in workloads(docs):
        for c in pod_spec(dep).get("containers", []):
            args = c.get("args") or []
            if args and args[0] in ROLES:
                out.append((dep, c, args[0]))
    return out


def role_deployments(docs: Iterable[Doc]) -> dict[str, Doc]:
    return {role: dep for dep, _c, role in tandem_containers(docs)}


def container_ports(container: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def resolve_port(port: int | str | None, container: Doc) -> int | None:
    """A probe / Service / policy port (number or container port name) as a number."""
    if port is None:
        return None
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    return container_ports(container).get(port)


def probe_port(probe: Doc, container: Doc) -> int | None:
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return resolve_port(probe[handler].get("port"), container)
    return None


_QUANTITY = re.compile(r"^([0-9.]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIX = {None: 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60}


def quantity(value: int | float | str) -> Fraction:
    """A Kubernetes resource quantity ('500m', '2Gi', 1) as an exact number."""
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    return Fraction(m.group(1)) * _SUFFIX[m.group(2)]


def selector_matches(selector: Doc | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelector semantics; an empty selector matches everything."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def services_selecting(docs: Iterable[Doc], deploy: Doc) -> list[Doc]:
    ns, labels = namespace_of(deploy), pod_labels(deploy)
    return [s for s in of_kind(docs, "Service")
            if namespace_of(s) == ns and s["spec"].get("selector")
            and all(labels.get(k) == v for k, v in s["spec"]["selector"].items())]


def container_env(container: Doc, docs: Iterable[Doc], namespace: str) -> dict[str, str]:
    """The container's environment: envFrom ConfigMaps (which must exist), then env values."""
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        ref = src.get("configMapRef")
        if ref:
            cm = find(docs, "ConfigMap", ref["name"])
            if cm is None or namespace_of(cm) != namespace:
                raise LookupError(f"envFrom ConfigMap {ref['name']!r} is not in the render")
            env.update({src.get("prefix", "") + k: v for k, v in (cm.get("data") or {}).items()})
    for var in container.get("env") or []:
        env[var["name"]] = var.get("value", "<valueFrom>")
    return env


def env_var(container: Doc, name: str) -> Doc | None:
    """The container's own `env` entry for `name` (None when it has none)."""
    return next((e for e in container.get("env") or [] if e["name"] == name), None)


def secret_ref(container: Doc, name: str) -> Doc | None:
    """The secretKeyRef an env var comes from (None for a literal, a ConfigMap or nothing)."""
    return ((env_var(container, name) or {}).get("valueFrom") or {}).get("secretKeyRef")


def prestop_command(container: Doc) -> list[str]:
    pre = ((container.get("lifecycle") or {}).get("preStop")) or {}
    return list((pre.get("exec") or {}).get("command") or [])


def is_drain_prestop(command: list[str]) -> bool:
    """`tandem drain --sleep N`: the worker (PID 1) leaves the registry, then N s pass."""
    return command[:2] == ["tandem", "drain"]


def prestop_sleep_s(container: Doc) -> float:
    pre = ((container.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = prestop_command(container)
    if len(cmd) == 2 and cmd[0].endswith("sleep"):
        return float(cmd[1])
    if is_drain_prestop(cmd):
        value = parse_flags(cmd[2:]).get("sleep", "")
        return float(value) if re.fullmatch(r"[0-9.]+", value) else 0.0
    return 0.0


# ------------------------------------------------------------------------------------ checks
# Each check returns a list of human-readable problems; [] means the render passes it.

def _bundled_schema_dir() -> Path:
    return Path(str(_resource_files("kubernetes_validate"))) / "kubernetes-json-schema" / \
        f"v{KUBE_VERSION}-local-strict"


@cache
def _k8s_definitions() -> Resource:
    return Resource.from_contents(
        json.loads((_bundled_schema_dir() / "_definitions.json").read_text()))


_DEFS = "/api/_definitions.json#/$defs/"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def crd_schema(api_version: str, kind: str, spec: dict) -> dict:
    """A strict schema for one custom resource: our `spec` schema under Kubernetes' envelope."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        # under the bundled definitions' base URI, so "/api/_definitions.json#..." resolves
        "$id": f"https://kubernetes.io/api/{kind.lower()}/{api_version}",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {"$ref": _DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
            "spec": spec,
        },
    }


# KEDA ScaledObject (keda.sh/v1alpha1, KEDA 2.x): the fields we use, strictly; the HPA behavior
# block is Kubernetes' own type, checked against the bundled definitions.
SCALED_OBJECT_SCHEMA = crd_schema("keda.sh/v1alpha1", "ScaledObject", {
    "type": "object",
    "required": ["scaleTargetRef", "triggers"],
    "additionalProperties": False,
    "properties": {
        "scaleTargetRef": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "name": {"type": "string", "minLength": 1},
                           "envSourceContainerName": {"type": "string"}}},
        "pollingInterval": {"type": "integer", "minimum": 1},
        "cooldownPeriod": {"type": "integer", "minimum": 0},
        "initialCooldownPeriod": {"type": "integer", "minimum": 0},
        "idleReplicaCount": {"type": "integer", "minimum": 0},
        "minReplicaCount": {"type": "integer", "minimum": 0},
        "maxReplicaCount": {"type": "integer", "minimum": 1},
        "fallback": {
            "type": "object", "required": ["failureThreshold", "replicas"],
            "properties": {"failureThreshold": {"type": "integer"},
                           "replicas": {"type": "integer"}}},
        "advanced": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "horizontalPodAutoscalerConfig": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string"},
                        "behavior": {"$ref": _DEFS + "io.k8s.api.autoscaling.v2."
                                     "HorizontalPodAutoscalerBehavior"}}},
                "scalingModifiers": {"type": "object"}}},
        "triggers": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object", "required": ["type", "metadata"],
                "additionalProperties": False,
                "properties": {
                    "type": {"type": "string", "minLength": 1},
                    "name": {"type": "string"},
                    "metadata": _STR_MAP,  # KEDA wants every value as a string
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "useCachedMetrics": {"type": "boolean"},
                    "authenticationRef": {
                        "type": "object", "required": ["name"],
                        "properties": {"name": {"type": "string"},
                                       "kind": {"type": "string"}}}}}}}})
# Prometheus Operator PodMonitor (monitoring.coreos.com/v1): the fields we use, strictly.
POD_MONITOR_SCHEMA = crd_schema("monitoring.coreos.com/v1", "PodMonitor", {
    "type": "object",
    "required": ["selector", "podMetricsEndpoints"],
    "additionalProperties": False,
    "properties": {
        "selector": {"$ref": _DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"},
        "namespaceSelector": {"type": "object"},
        "jobLabel": {"type": "string"},
        "podMetricsEndpoints": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object", "required": ["port"], "additionalProperties": False,
                "properties": {
                    "port": {"type": "string", "minLength": 1},
                    "path": {"type": "string", "pattern": "^/"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scrapeTimeout": {"type": "string"},
                    "scheme": {"enum": ["http", "https"]}}}}}})
_INT_OR_STRING = {"anyOf": [{"type": "integer", "minimum": 0},
                            {"type": "string", "pattern": "^[0-9]+%?$"}]}
# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, LWS 0.6+): the fields of its CRD, strictly; the
# pod templates are Kubernetes' own PodTemplateSpec, checked against the bundled definitions.
LEADER_WORKER_SET_SCHEMA = crd_schema(LWS_API, "LeaderWorkerSet", {
    "type": "object",
    "required": ["leaderWorkerTemplate"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "rolloutStrategy": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "type": {"enum": ["RollingUpdate"]},
                "rollingUpdateConfiguration": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"partition": {"type": "integer", "minimum": 0},
                                   "maxUnavailable": _INT_OR_STRING,
                                   "maxSurge": _INT_OR_STRING}}}},
        "networkConfig": {
            "type": "object", "additionalProperties": False,
            "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
        "leaderWorkerTemplate": {
            "type": "object", "required": ["workerTemplate"], "additionalProperties": False,
            "properties": {
                "leaderTemplate": {"$ref": _DEFS + "io.k8s.api.core.v1.PodTemplateSpec"},
                "workerTemplate": {"$ref": _DEFS + "io.k8s.api.core.v1.PodTemplateSpec"},
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                "subGroupPolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"subGroupSize": {"type": "integer", "minimum": 1},
                                   "type": {"enum": ["LeaderWorker", "LeaderExcluded"]}}}}}}})
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT_SCHEMA,
               ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SCHEMA,
               (LWS_API, "LeaderWorkerSet"): LEADER_WORKER_SET_SCHEMA}
# The label kube-prometheus-stack's Prometheus selects PodMonitors by (podMonitorSelector).
POD_MONITOR_SELECTOR_LABEL = "release"


@cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """A validator per kind, built once (kubernetes_validate.validate reloads the 1.2 MB
    definitions on every call). The schema file is found the way kubernetes-validate finds it:
    apps/v1 Deployment -> deployment-apps-v1.json, networking.k8s.io/v1 -> networking-v1."""
    crd = CRD_SCHEMAS.get((api_version, kind))
    if crd is not None:
        schema = crd
    else:
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        path = _bundled_schema_dir() / f"{kind.lower()}-{group_version}.json"
        if not path.is_file():
            return None
        schema = json.loads(path.read_text())
    return jsonschema.Draft202012Validator(schema, registry=_k8s_definitions() @ Registry())


def schema_problems(doc: Doc) -> list[str]:
    validator = _validator(str(doc.get("apiVersion")), str(doc.get("kind")))
    if validator is None:
        return [f"{name_of(doc)}: no schema for {doc.get('apiVersion')} {doc.get('kind')} in "
                f"Kubernetes {KUBE_VERSION}; add a structural check (CRD_SCHEMAS)"]
    return [f"{name_of(doc)}: {'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))]


# No policy tool knows this: the CRDs' (KEDA, LWS) schemas; the rest is kubernetes-validate's.
def check_schemas(docs: list[Doc]) -> list[str]:
    """Every document against the Kubernetes schemas (strict), CRDs against ours."""
    return [p for doc in docs for p in schema_problems(doc)]


# Probes and cpu/memory requests and limits being there: checkov (test_policies.py). Here
# what it does not see: a probe's named port resolving, request <= limit, GPUs not overcommitted.
def check_probes_and_resources(docs: list[Doc]) -> list[str]:
    problems = []
    for dep in workloads(docs):
        inits = pod_spec(dep).get("initContainers", [])
        for c in inits + pod_spec(dep)["containers"]:
            where = f"{name_of(dep)} container {c['name']}"
            if c not in inits:
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe in c and probe_port(c[probe], c) is None and "exec" not in c[probe]:
                        problems.append(f"{where}: {probe} has no resolvable port")
            res = c.get("resources") or {}
            requests, limits = res.get("requests") or {}, res.get("limits") or {}
            for kind in ("cpu", "memory"):
                if kind in requests and kind in limits and \
                        quantity(requests[kind]) > quantity(limits[kind]):
                    problems.append(f"{where}: {kind} request {requests[kind]} > limit "
                                    f"{limits[kind]}")
            if GPU in requests or GPU in limits:
                if GPU not in limits:
                    problems.append(f"{where}: {GPU} requested without a limit")
                elif GPU in requests and quantity(requests[GPU]) != quantity(limits[GPU]):
                    problems.append(f"{where}: {GPU} request != limit (extended resources "
                                    "cannot be overcommitted)")
    return problems


# No policy tool knows this: --port flags must agree with containerPorts, probes and Services.
def check_ports(docs: list[Doc]) -> list[str]:
    """--port == containerPort == probe ports == Service targetPort, per tandem container."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        where = f"{name_of(dep)} ({role})"
        flags = parse_flags(c["args"][1:])
        if "port" not in flags:
            problems.append(f"{where}: no --port in args")
            continue
        port = int(flags["port"])
        declared = {p["containerPort"] for p in c.get("ports", [])}
        if port not in declared:
            problems.append(f"{where}: --port {port} is not a containerPort {sorted(declared)}")
        probed = probed_port(dep, c)
        if probed not in declared:
            problems.append(f"{where}: its probes' port {probed} is not a containerPort")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c and probe_port(c[probe], c) != probed:
                problems.append(f"{where}: {probe} port {probe_port(c[probe], c)} != "
                                f"{'--port' if probed == port else 'the rendezvous port'} "
                                f"{probed}")
        # every role serves /metrics on a port of its own (the gateway: off its public API)
        metrics_port = port
        if "metrics-port" not in flags:
            problems.append(f"{where}: no --metrics-port")
        else:
            metrics_port = int(flags["metrics-port"])
            if container_ports(c).get("metrics") != metrics_port:
                problems.append(f"{where}: --metrics-port {metrics_port} is not the "
                                "containerPort named `metrics`")
            if metrics_port == port:
                problems.append(f"{where}: --metrics-port must differ from --port {port}")
        annotations = dep["spec"]["template"]["metadata"].get("annotations") or {}
        if annotations.get("prometheus.io/scrape") == "true" and \
                annotations.get("prometheus.io/port") != str(metrics_port):
            problems.append(f"{where}: prometheus.io/port {annotations.get('prometheus.io/port')}"
                            f" != metrics port {metrics_port}")
        services = services_selecting(docs, dep)
        if not services:
            problems.append(f"{where}: no Service selects its pods")
        targets = set()
        for svc in services:
            for sp in svc["spec"]["ports"]:
                tp = resolve_port(sp.get("targetPort", sp["port"]), c)
                targets.add(tp)
                if tp is None or tp not in declared:
                    problems.append(f"{name_of(svc)} port {sp.get('name')}: targetPort "
                                    f"{sp.get('targetPort')!r} is no containerPort of {where}")
        if services and port not in targets:
            problems.append(f"{where}: no Service targets --port {port}")
    # every other Service must reach a declared port of some pod it selects
    for svc in of_kind(docs, "Service"):
        selected = [d for d in workloads(docs) if svc in services_selecting(docs, d)]
        if not selected:
            problems.append(f"{name_of(svc)}: selects no workload's pods")
            continue
        for sp in svc["spec"]["ports"]:
            ok = any(resolve_port(sp.get("targetPort", sp["port"]), c)
                     in {p["containerPort"] for p in c.get("ports", [])}
                     for d in selected for c in pod_spec(d)["containers"])
            if not ok:
                problems.append(f"{name_of(svc)} port {sp.get('name')}: targetPort "
                                f"{sp.get('targetPort')!r} matches no containerPort")
    return problems


# No policy tool knows this: which roles get headless Services, what the gateway exposes.
def check_services(docs: list[Doc]) -> list[str]:
    """Worker pools behind headless Services (HTTP/2 pins connections); the gateway ClusterIP,
    exposing its API port only (never /metrics)."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        for svc in services_selecting(docs, dep):
            if role == "gateway":
                api = int(parse_flags(c["args"][1:])["port"])
                exposed = {resolve_port(sp.get("targetPort", sp["port"]), c)
                           for sp in svc["spec"]["ports"]}
                if exposed != {api}:
                    problems.append(f"{name_of(svc)} (gateway) exposes {sorted(map(str, exposed))}"
                                    f"; only the API port {api} belongs on it")
            spec = svc["spec"]
            if role in WORKER_ROLES:
                if spec.get("clusterIP") != "None":
                    problems.append(f"{name_of(svc)} ({role} pool) must be headless "
                                    "(clusterIP: None)")
                for sp in spec["ports"]:
                    if resolve_port(sp.get("targetPort", sp["port"]), c) != sp["port"]:
                        problems.append(f"{name_of(svc)}: a headless Service maps no ports; "
                                        f"port {sp['port']} must equal its targetPort")
            elif spec.get("type", "ClusterIP") != "ClusterIP" or spec.get("clusterIP") == "None":
                problems.append(f"{name_of(svc)} (gateway) should be a ClusterIP Service")
    return problems


def _autoscaler_metrics(doc: Doc) -> tuple[set[str], list[str]]:
    """(tandem metric names used, other problems) of an HPA or a ScaledObject."""
    names, problems = set(), []
    if doc["kind"] == "HorizontalPodAutoscaler":
        for m in doc["spec"].get("metrics") or []:
            if m["type"] == "Resource":
                continue
            key = {"Pods": "pods", "Object": "object", "External": "external",
                   "ContainerResource": None}[m["type"]]
            if key is None:
                continue
            names.add(m[key]["metric"]["name"])
    else:
        for t in doc["spec"]["triggers"]:
            if t["type"] in ("cpu", "memory"):
                continue
            if t["type"] != "prometheus":
                problems.append(f"{name_of(doc)}: unexpected trigger type {t['type']!r}")
                continue
            query = t["metadata"].get("query", "")
            used = set(re.findall(r"\btandem_[a-z0-9_]+", query))
            if not used:
                problems.append(f"{name_of(doc)}: query {query!r} reads no tandem metric")
            names |= used
            for key in ("serverAddress", "threshold"):
                if key not in t["metadata"]:
                    problems.append(f"{name_of(doc)}: prometheus trigger without {key}")
    return names, problems


# No policy tool knows this: autoscalers must read the gauges Tandem's workers export.
def check_autoscalers(docs: list[Doc]) -> list[str]:
    problems = []
    roles = role_deployments(docs)
    role_of = {dep["metadata"]["name"]: role for role, dep in roles.items()}
    scalers = of_kind(docs, "HorizontalPodAutoscaler") + of_kind(docs, "ScaledObject")
    targeted: dict[str, list[str]] = {}
    for doc in scalers:
        ref = doc["spec"]["scaleTargetRef"]
        kind = ref.get("kind", "Deployment")
        target = find(docs, kind, ref["name"])
        api = {"Deployment": "apps/v1", "LeaderWorkerSet": LWS_API}.get(kind)
        if kind not in SCALABLE_KINDS or target is None or \
                namespace_of(target) != namespace_of(doc) or \
                ref.get("apiVersion", api) != api:
            problems.append(f"{name_of(doc)}: scaleTargetRef {ref.get('kind')}/{ref['name']} "
                            f"is not a {' or '.join(SCALABLE_KINDS)} in this render")
            continue
        targeted.setdefault(ref["name"], []).append(name_of(doc))
        names, more = _autoscaler_metrics(doc)
        problems += more
        unknown = names - ALLOWED_METRICS
        if unknown:
            problems.append(f"{name_of(doc)}: unknown metrics {sorted(unknown)} (exported: "
                            f"{sorted(ALLOWED_METRICS)})")
        role = role_of.get(ref["name"])
        if role is not None:
            foreign = names & (ALLOWED_METRICS - ROLE_METRICS[role])
            if foreign:
                problems.append(f"{name_of(doc)}: scales the {role} pool on another role's "
                                f"metrics {sorted(foreign)}")
            missing = REQUIRED_METRICS.get(role, set()) - names
            if missing:
                problems.append(f"{name_of(doc)}: the {role} pool must scale on "
                                f"{sorted(missing)}")
        spec = doc["spec"]
        lo = spec.get("minReplicas", spec.get("minReplicaCount", 1))
        hi = spec.get("maxReplicas", spec.get("maxReplicaCount"))
        if hi is None or lo > hi:
            problems.append(f"{name_of(doc)}: bounds {lo}..{hi}")
        if "replicas" in target["spec"]:
            # every `kubectl apply` would reset the count the autoscaler chose
            problems.append(f"{name_of(target)}: sets spec.replicas "
                            f"({target['spec']['replicas']!r}) although {name_of(doc)} owns it")
        behavior = spec.get("behavior") if doc["kind"] == "HorizontalPodAutoscaler" else \
            ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get(
                "behavior")
        if role in WORKER_ROLES and not (behavior and "scaleUp" in behavior
                                         and "scaleDown" in behavior):
            problems.append(f"{name_of(doc)}: pools need explicit scaleUp and scaleDown behavior")
    for name, owners in targeted.items():
        if len(owners) > 1:
            problems.append(f"{name} has {len(owners)} autoscalers {owners}: they would "
                            "fight")
    for role in WORKER_ROLES:
        if role in roles and roles[role]["metadata"]["name"] not in targeted:
            problems.append(f"the {role} pool has no autoscaler of its own")
    return problems


# NetworkPolicy evaluation over the render's pods plus a few stand-ins from outside.
_OUTSIDERS = [
    ("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
    ("foreign-pod", "other", {"app": "something-else"}),
    ("same-namespace-stranger", None, {"app": "debug-shell"}),
]


def _policy_pods(docs: list[Doc]) -> list[tuple[str, str, dict[str, str], list[Doc]]]:
    """(who, namespace, labels, containers) for each Deployment's pods and the outsiders."""
    pods = []
    for dep in workloads(docs):
        labels = pod_labels(dep)
        who = labels.get("app.kubernetes.io/component") if labels.get(
            "app.kubernetes.io/name") == "tandem" else dep["metadata"]["name"]
        pods.append((who, namespace_of(dep), labels, pod_spec(dep)["containers"]))
    home = namespace_of(role_deployments(docs).get("gateway", {"metadata": {}}))
    for who, ns, labels in _OUTSIDERS:
        pods.append((who, ns or home, labels, []))
    return pods


def _peer_matches(peer: Doc, policy_ns: str, src_ns: str, src_labels: dict[str, str]) -> bool:
    if "ipBlock" in peer:  # conservatively: a CIDR can match anything, pods included
        return True
    ns_labels = {"kubernetes.io/metadata.name": src_ns}
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], ns_labels):
            return False
    elif src_ns != policy_ns:
        return False
    return selector_matches(peer.get("podSelector"), src_labels)


def _port_matches(rule_ports: list[Doc] | None, port: int, containers: list[Doc]) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        if rp.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in rp:
            return True
        start = rp["port"] if isinstance(rp["port"], int) else next(
            (resolve_port(rp["port"], c) for c in containers
             if resolve_port(rp["port"], c) is not None), None)
        if start is not None and start <= port <= rp.get("endPort", start):
            return True
    return False


def ingress_allowed(docs: list[Doc], src: tuple, dst: tuple, port: int) -> bool:
    _, src_ns, src_labels, _ = src
    _, dst_ns, dst_labels, dst_containers = dst
    selecting = [p for p in of_kind(docs, "NetworkPolicy")
                 if namespace_of(p) == dst_ns
                 and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
                 and selector_matches(p["spec"].get("podSelector"), dst_labels)]
    if not selecting:
        return True  # not isolated
    for pol in selecting:
        for rule in pol["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(_peer_matches(peer, dst_ns, src_ns, src_labels)
                                 for peer in peers):
                continue
            if _port_matches(rule.get("ports"), port, dst_containers):
                return True
    return False


def allowed_sources(docs: list[Doc], dst_who: str, port: int) -> set[str]:
    pods = _policy_pods(docs)
    dst = next(p for p in pods if p[0] == dst_who)
    return {src[0] for src in pods if ingress_allowed(docs, src, dst, port)}


# No policy tool knows this: only the gateway reaches verifiers, only verifiers drafts.
def check_network_policies(docs: list[Doc]) -> list[str]:
    problems = []
    if not of_kind(docs, "NetworkPolicy"):
        return ["no NetworkPolicy in the render"]
    roles = role_deployments(docs)
    ports = {role: int(parse_flags(c["args"][1:])["port"])
             for _d, c, role in tandem_containers(docs)}
    metrics = {role: int(parse_flags(c["args"][1:]).get("metrics-port", 0))
               for _d, c, role in tandem_containers(docs)}
    expectations = [  # (destination, port, exactly these sources may connect)
        ("verifier", ports.get("verifier"), {"gateway"}),
        ("draft", ports.get("draft"), {"verifier"}),
        *[(role, metrics[role], {"prometheus"}) for role in ROLES if metrics.get(role)],
    ]
    for dst, port, wanted in expectations:
        if dst not in roles or port is None:
            problems.append(f"no {dst} pool to check")
            continue
        got = allowed_sources(docs, dst, port)
        if got != wanted:
            problems.append(f"{dst}:{port} is reachable from {sorted(got)}; only "
                            f"{sorted(wanted)} may reach it")
    # what must still work: the public reaches the gateway, every role reaches Redis and the
    # collector
    musts = [("foreign-pod", "gateway", ports.get("gateway"))]
    pods = _policy_pods(docs)
    for who, _ns, _labels, containers in pods:
        if who in ("redis", "otel-collector"):
            musts += [(role, who, p["containerPort"]) for role in ROLES
                      for c in containers for p in c.get("ports", [])
                      if p["name"] != "health"]
    for src_who, dst_who, port in musts:
        if port is not None and src_who not in allowed_sources(docs, dst_who, port):
            problems.append(f"{src_who} cannot reach {dst_who}:{port}")
    # default deny: every pod of the render is isolated for ingress by some policy
    for who, ns, labels, containers in pods:
        if containers and not any(
                namespace_of(p) == ns and selector_matches(p["spec"].get("podSelector"), labels)
                and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
                for p in of_kind(docs, "NetworkPolicy")):
            problems.append(f"{who} pods are selected by no ingress NetworkPolicy (open to all)")
    return problems


def _env_or_flag(env: dict[str, str], flags: dict[str, str], var: str, flag: str,
                 default: float | None) -> float | None:
    """A number the process reads from --flag or its env var (the flag wins), else default."""
    value = flags.get(flag, env.get(var))
    if value is None or value == "<valueFrom>":
        return default
    return float(value)


# No policy tool knows this: grace periods against Tandem's drain and request timeouts.
def check_termination(docs: list[Doc]) -> list[str]:
    """Every tandem pod gets to finish its work before SIGKILL.

    Workers: the preStop is `tandem drain --sleep N` (signals PID 1, the image's `tandem`
    ENTRYPOINT, to leave the registry and refuse new sessions, then waits for endpoints to drop),
    and the grace exceeds that sleep + the registry leave + --drain-grace-s. Gateway: a preStop
    sleep, and a grace covering it plus TANDEM_GATEWAY_SHUTDOWN_GRACE_S, itself at least the
    request timeout (else a rollout cuts streams)."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        where = name_of(dep)
        spec = pod_spec(dep)
        grace = spec.get("terminationGracePeriodSeconds", 30)
        sleep = prestop_sleep_s(c)
        command = prestop_command(c)
        flags = parse_flags(c["args"][1:])
        if sleep <= 0:
            problems.append(f"{where}: no preStop sleep (endpoints must drop the pod "
                            "before SIGTERM)")
        if role in WORKER_ROLES:
            if not is_drain_prestop(command):
                problems.append(f"{where}: preStop must be `tandem drain --sleep N` (leave the "
                                f"registry at once), not {command or 'a bare sleep'}")
            # `tandem drain` signals PID 1: that must be the worker itself
            if c.get("command"):
                problems.append(f"{where}: `command` replaces the `tandem` ENTRYPOINT, so PID 1 "
                                "is not the worker `tandem drain` signals")
            if spec.get("shareProcessNamespace"):
                problems.append(f"{where}: shareProcessNamespace makes PID 1 the pause "
                                "process; `tandem drain` would signal it")
            env_name = f"TANDEM_{role.upper()}_DRAIN_GRACE_S"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            drain = float(flags.get("drain-grace-s", env.get(env_name) or DEFAULT_DRAIN_GRACE_S))
            need = sleep + REGISTRY_LEAVE_S + drain
            if not grace > need:
                problems.append(f"{where}: terminationGracePeriodSeconds {grace} must exceed "
                                f"{need:g} s (preStop sleep + registry leave + drain)")
            continue
        env = container_env(c, docs, namespace_of(dep))
        timeout = _env_or_flag(env, flags, "TANDEM_GATEWAY_REQUEST_TIMEOUT", "request-timeout",
                               DEFAULT_REQUEST_TIMEOUT_S)
        shutdown = _env_or_flag(env, flags, "TANDEM_GATEWAY_SHUTDOWN_GRACE_S",
                                "shutdown-grace-s", None)
        if shutdown is None:
            problems.append(f"{where}: no TANDEM_GATEWAY_SHUTDOWN_GRACE_S (how long SIGTERM "
                            "waits for open requests)")
            continue
        if shutdown < timeout:
            problems.append(f"{where}: TANDEM_GATEWAY_SHUTDOWN_GRACE_S {shutdown:g} < the request "
                            f"timeout {timeout:g}: a rollout would cut requests short")
        if grace < sleep + shutdown:
            problems.append(f"{where}: terminationGracePeriodSeconds {grace} < preStop sleep "
                            f"{sleep:g} + shutdown grace {shutdown:g}")
    return problems


# No policy tool knows this: readiness must follow Tandem's drain (/health).
def check_readiness(docs: list[Doc]) -> list[str]:
    """Readiness follows the drain, so Services and clients stop routing to a draining pod:
    workers probe gRPC health on their service name (NOT_SERVING while draining); with TLS
    (kubelet gRPC probes speak plaintext) a TCP check of the gRPC port, which closes when the
    drain begins. The gateway: HTTP /health on its API port."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        probe = c.get("readinessProbe") or {}
        port = int(parse_flags(c["args"][1:])["port"])
        where = f"{name_of(dep)} readinessProbe"
        if role == "gateway":
            if (probe.get("httpGet") or {}).get("path") != "/health":
                problems.append(f"{where}: want httpGet /health")
            continue
        tls = env_var(c, "TANDEM_TLS_CERT") is not None
        grpc = probe.get("grpc")
        if probed_port(dep, c) != port:  # a LeaderWorkerSet's leader under LeaderReady
            if probe_port(probe, c) != probed_port(dep, c) or "tcpSocket" not in probe:
                problems.append(f"{where}: under startupPolicy LeaderReady, a TCP check of the "
                                f"rendezvous port {probed_port(dep, c)} (the gRPC port opens "
                                "only once the workers the leader's readiness admits joined)")
        elif grpc is not None:
            if grpc.get("service") != HEALTH_SERVICES[role]:
                problems.append(f"{where}: gRPC health must ask for {HEALTH_SERVICES[role]!r} "
                                f"(NOT_SERVING while draining), not {grpc.get('service')!r}")
            if tls:
                problems.append(f"{where}: a gRPC probe cannot speak TLS")
        elif tls and "tcpSocket" in probe:
            if probe_port(probe, c) != port:
                problems.append(f"{where}: TCP check of {probe_port(probe, c)}, not the gRPC port")
        else:
            problems.append(f"{where}: want gRPC health on {HEALTH_SERVICES[role]!r} (or, with "
                            "TLS, a TCP check of the gRPC port)")
    return problems


# The collector's standard ports per OTLP transport, for every protocol tandem.telemetry exports.
OTLP_PORTS = MappingProxyType({"grpc": 4317, "http/protobuf": 4318})


# No policy tool knows this: TANDEM_* / OTEL_* env and flags wired to the right peers.
def check_env_wiring(docs: list[Doc]) -> list[str]:
    """OTEL_* and REDIS_URL reach Services of the render; one OTEL service name per role."""
    problems = []
    service_names = set()
    for dep, c, _role in tandem_containers(docs):
        try:
            env = container_env(c, docs, namespace_of(dep))
        except LookupError as exc:
            problems.append(f"{name_of(dep)}: {exc}")
            continue
        name = env.get("OTEL_SERVICE_NAME")
        if not name:
            problems.append(f"{name_of(dep)}: no OTEL_SERVICE_NAME")
        service_names.add(name)
        if env.get("OTEL_TRACES_EXPORTER") != "otlp":
            problems.append(f"{name_of(dep)}: OTEL_TRACES_EXPORTER should be otlp")
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        url = urlsplit(endpoint)
        host = (url.hostname or "").split(".")[0]
        svc = find(docs, "Service", host)
        if svc is None or url.port not in {p["port"] for p in svc["spec"]["ports"]}:
            problems.append(f"{name_of(dep)}: OTEL_EXPORTER_OTLP_ENDPOINT {endpoint!r} is not "
                            "a Service port in this render")
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        if protocol not in OTLP_PORTS:
            problems.append(f"{name_of(dep)}: OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not one "
                            f"the services export ({', '.join(OTLP_PORTS)})")
        elif url.port != OTLP_PORTS[protocol]:
            problems.append(f"{name_of(dep)}: OTLP over {protocol} to port {url.port}; the "
                            f"collector takes {protocol} on {OTLP_PORTS[protocol]}")
        if secret_ref(c, "REDIS_URL") is not None:
            continue  # an external Redis: the URL is in the Secret (check_redis_durable)
        redis = urlsplit(env.get("REDIS_URL", ""))
        if redis.scheme not in ("redis", "rediss"):
            problems.append(f"{name_of(dep)}: REDIS_URL {env.get('REDIS_URL')!r} is no redis URL")
        elif "." not in (redis.hostname or "") and not any(
                s["metadata"]["name"] == redis.hostname
                and (redis.port or 6379) in {p["port"] for p in s["spec"]["ports"]}
                for s in of_kind(docs, "Service")):
            # a short name is an in-cluster Service of this render (a managed Redis has an FQDN)
            problems.append(f"{name_of(dep)}: REDIS_URL host {redis.hostname!r} is not a "
                            "Service port in this render")
    if len(service_names) != len(tandem_containers(docs)):
        problems.append("OTEL_SERVICE_NAME must differ per role: "
                        f"{sorted(map(str, service_names))}")
    return problems


# No policy tool knows this: a ServiceAccount per Tandem role, a PDB per pool.
def check_workload_hygiene(docs: list[Doc]) -> list[str]:
    """ServiceAccount per role, a PDB per pool (non-root and no privilege escalation:
    checkov, test_policies.py)."""
    problems = []
    accounts = set()
    for dep, _c, _role in tandem_containers(docs):
        spec = pod_spec(dep)
        sa = spec.get("serviceAccountName")
        if not sa or find(docs, "ServiceAccount", sa) is None:
            problems.append(f"{name_of(dep)}: ServiceAccount {sa!r} not in the render")
        accounts.add(sa)
        pdbs = [p for p in of_kind(docs, "PodDisruptionBudget")
                if selector_matches(p["spec"].get("selector"), pod_labels(dep))]
        if len(pdbs) != 1:
            problems.append(f"{name_of(dep)}: {len(pdbs)} PodDisruptionBudgets select it, "
                            "want 1")
    if len(accounts) != len(tandem_containers(docs)):
        problems.append("each role needs its own ServiceAccount")
    missing = set(ROLES) - set(role_deployments(docs))
    if missing:
        problems.append(f"no Deployment for {sorted(missing)}")
    return problems


def image_tag(image: str) -> str:
    name = image.split("@", 1)[0]
    return name.rpartition(":")[2] if ":" in name.rpartition("/")[2] else ""


def requests_gpu(spec: Doc) -> bool:
    return any(GPU in ((c.get("resources") or {}).get(part) or {})
               for c in spec.get("containers", []) + spec.get("initContainers", [])
               for part in ("requests", "limits"))


# No policy tool knows this: which build (CPU / CUDA) each role runs; kustomize's logical names.
def check_images(docs: list[Doc]) -> list[str]:
    """The logical image names all mapped (pinned tags: checkov's CKV_K8S_14); verifier and
    draft on one image, the CUDA build where they get GPUs; the gateway on the CPU build (it
    only tokenizes) and no GPU."""
    problems = []
    images = {role: (dep, c["image"]) for dep, c, role in tandem_containers(docs)}
    for dep, image in images.values():
        if image in LOGICAL_IMAGES.values():
            problems.append(f"{name_of(dep)}: image {image!r} is a logical name no `images:` "
                            "entry mapped")
    workers = {images[r][1] for r in WORKER_ROLES if r in images}
    if len(workers) > 1:
        problems.append(f"verifier and draft run one image, got {sorted(workers)}")
    for role in WORKER_ROLES:
        if role in images and requests_gpu(pod_spec(images[role][0])) and \
                "cuda" not in image_tag(images[role][1]):
            problems.append(f"{name_of(images[role][0])}: GPUs but the image "
                            f"{images[role][1]!r} is not the CUDA build")
    if "gateway" in images:
        dep, image = images["gateway"]
        if "cuda" in image.lower():
            problems.append(f"{name_of(dep)}: the gateway runs the CPU image, not {image!r}")
        if requests_gpu(pod_spec(dep)):
            problems.append(f"{name_of(dep)}: the gateway must not ask for a GPU")
    return problems


# ConfigMap keys and values that are secrets, whatever the ConfigMap (TANDEM_REQUIRE_API_KEYS
# and TANDEM_API_KEYS_FILE are settings, not secrets)
_SECRET_KEY = re.compile(r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN)$|^TANDEM_API_KEYS$|"
                         r"^OTEL_EXPORTER_OTLP(_TRACES)?_HEADERS$")
_SECRET_VALUE = re.compile(r"sha256:[0-9a-fA-F]{64}|[a-z][a-z0-9+.-]*://[^/\s@:]*:[^/\s@]+@")
SECRET_ENV = ("REDIS_PASSWORD", "TANDEM_API_KEYS")  # never a literal, never from a ConfigMap


def _redis_secret_ok(docs: list[Doc], ref: Doc | None, key: str) -> bool:
    """A secretKeyRef to the Redis Secret: tandem-redis (created by hand), or the render's own
    generated one (tandem-redis-<hash>, dev) holding that key."""
    if not ref or ref.get("key") != key or ref.get("optional"):
        return False
    if ref["name"] == REDIS_SECRET:
        return True
    secret = find(docs, "Secret", ref["name"])
    return bool(secret and ref["name"].startswith(REDIS_SECRET + "-")
                and key in {**(secret.get("data") or {}), **(secret.get("stringData") or {})})


# No policy tool knows this: which of Tandem's settings are secrets, where they may come from.
def check_secrets(docs: list[Doc]) -> list[str]:
    """API keys and the Redis password come from Secrets only: no ConfigMap and no literal env
    holds one; every tandem process and the in-cluster Redis read REDIS_PASSWORD from the Secret
    tandem-redis; the gateway's keys file is the Secret tandem-api-keys, mounted read-only."""
    problems = []
    for cm in of_kind(docs, "ConfigMap"):
        for key, value in (cm.get("data") or {}).items():
            if _SECRET_KEY.search(key):
                problems.append(f"{name_of(cm)}: {key} is a secret; it belongs in a Secret")
            if _SECRET_VALUE.search(str(value)):
                problems.append(f"{name_of(cm)}: {key} holds a credential (a key digest or a "
                                "URL with a password)")
    for dep in workloads(docs):
        for c in pod_spec(dep).get("containers", []) + pod_spec(dep).get("initContainers", []):
            for var in c.get("env") or []:
                literal = var.get("value")
                if var["name"] in SECRET_ENV and "secretKeyRef" not in (var.get("valueFrom") or {}):
                    problems.append(f"{name_of(dep)}: env {var['name']} must come from a Secret "
                                    "(secretKeyRef)")
                elif literal and _SECRET_VALUE.search(literal):
                    problems.append(f"{name_of(dep)}: env {var['name']} holds a credential")
    for dep, c, role in tandem_containers(docs):
        if not _redis_secret_ok(docs, secret_ref(c, "REDIS_PASSWORD"), "password"):
            problems.append(f"{name_of(dep)}: REDIS_PASSWORD must come from the Secret "
                            f"{REDIS_SECRET} (key `password`)")
        if env_var(c, "TANDEM_API_KEYS") is not None:
            problems.append(f"{name_of(dep)}: TANDEM_API_KEYS puts keys in the pod spec; mount "
                            f"the Secret {API_KEYS_SECRET} (TANDEM_API_KEYS_FILE)")
        if role == "gateway":
            problems += _api_keys_problems(dep, c)
    for dep, c in redis_containers(docs):
        flags = parse_flags(c.get("args") or [])
        if flags.get("requirepass") != "$(REDIS_PASSWORD)" or \
                not _redis_secret_ok(docs, secret_ref(c, "REDIS_PASSWORD"), "password"):
            problems.append(f"{name_of(dep)}: Redis must run with --requirepass "
                            f"$(REDIS_PASSWORD), REDIS_PASSWORD from the Secret {REDIS_SECRET}")
    return problems


def _api_keys_problems(dep: Doc, c: Doc) -> list[str]:
    """TANDEM_API_KEYS_FILE, when set, is key `keys` of the Secret tandem-api-keys, mounted
    read-only; TANDEM_REQUIRE_API_KEYS needs it."""
    where = name_of(dep)
    path = (env_var(c, "TANDEM_API_KEYS_FILE") or {}).get("value")
    require = (env_var(c, "TANDEM_REQUIRE_API_KEYS") or {}).get("value", "")
    if not path:
        return [f"{where}: TANDEM_REQUIRE_API_KEYS without TANDEM_API_KEYS_FILE"] \
            if require.lower() in ("1", "true", "yes", "on") else []
    volumes = {v["name"]: v for v in pod_spec(dep).get("volumes") or []}
    for mount in c.get("volumeMounts") or []:
        directory = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(directory):
            continue
        secret = (volumes.get(mount["name"]) or {}).get("secret") or {}
        relative = path[len(directory):]
        items = {i["path"]: i["key"] for i in secret.get("items") or []}
        key = items.get(relative, None if items else relative)
        if secret.get("secretName") != API_KEYS_SECRET or key != "keys" or \
                mount.get("subPath") or secret.get("optional"):
            return [f"{where}: TANDEM_API_KEYS_FILE {path} is not key `keys` of the Secret "
                    f"{API_KEYS_SECRET}"]
        if not mount.get("readOnly"):
            return [f"{where}: mount {API_KEYS_SECRET} read-only"]
        return []
    return [f"{where}: TANDEM_API_KEYS_FILE {path} is in no mounted volume"]


def redis_workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in workloads(docs)
            if pod_labels(d).get("app.kubernetes.io/component") == "redis"]


def redis_containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    return [(d, c) for d in redis_workloads(docs) for c in pod_spec(d)["containers"]
            if c["name"] == "redis" or c["image"].split(":")[0].endswith("redis")]


# No policy tool knows this: the session store's Redis durable and authenticated.
def check_redis_durable(docs: list[Doc]) -> list[str]:
    """Production Redis survives a restart: a single-master StatefulSet with a PersistentVolume
    (volumeClaimTemplates), the append-only file on it, a password and a headless governing
    Service; or no in-cluster Redis and REDIS_URL from a Secret (a managed one). Never the
    ephemeral Deployment (dev only). Not in ALL_CHECKS: dev keeps the ephemeral one."""
    problems = []
    redis = redis_workloads(docs)
    for dep in redis:
        if dep["kind"] != "StatefulSet":
            problems.append(f"{name_of(dep)}: an ephemeral Redis {dep['kind']}; production "
                            "runs the StatefulSet or an external Redis")
            continue
        spec = dep["spec"]
        if spec.get("replicas", 1) != 1:
            problems.append(f"{name_of(dep)}: {spec['replicas']} replicas would be unrelated "
                            "masters; run one")
        claims = {t["metadata"]["name"]: t for t in spec.get("volumeClaimTemplates") or []}
        ((_d, c),) = [(d, c) for d, c in redis_containers(docs) if d is dep] or [(None, {})]
        flags = parse_flags(c.get("args") or [])
        if flags.get("appendonly") != "yes":
            problems.append(f"{name_of(dep)}: want --appendonly yes (the AOF on the volume)")
        data = next((m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/data"), None)
        claim = claims.get((data or {}).get("name"))
        if claim is None:
            problems.append(f"{name_of(dep)}: /data is not a volumeClaimTemplate")
        elif "storage" not in ((claim["spec"].get("resources") or {}).get("requests") or {}):
            problems.append(f"{name_of(dep)}: claim {claim['metadata']['name']} requests no "
                            "storage")
        if flags.get("requirepass") != "$(REDIS_PASSWORD)":
            problems.append(f"{name_of(dep)}: no --requirepass $(REDIS_PASSWORD)")
        svc = find(docs, "Service", spec.get("serviceName", ""))
        if svc is None or svc["spec"].get("clusterIP") != "None" or \
                svc not in services_selecting(docs, dep):
            problems.append(f"{name_of(dep)}: serviceName {spec.get('serviceName')!r} must be a "
                            "headless Service selecting its pod")
    if not redis:
        for dep, c, _role in tandem_containers(docs):
            if not _redis_secret_ok(docs, secret_ref(c, "REDIS_URL"), "url"):
                problems.append(f"{name_of(dep)}: no in-cluster Redis, so REDIS_URL must come "
                                f"from the Secret {REDIS_SECRET} (key `url`)")
        for cm in of_kind(docs, "ConfigMap"):
            if "REDIS_URL" in (cm.get("data") or {}):
                problems.append(f"{name_of(cm)}: REDIS_URL here would name a Redis that is not "
                                "deployed (and env from the Secret shadows it)")
    return problems


_POD_IP_JOINED = re.compile(r"\[\$\(POD_IP\)|\$\(POD_IP\)\]?:")


# No policy tool knows this: dual-stack addresses in Tandem's flags and env.
def check_addresses(docs: list[Doc]) -> list[str]:
    """Dual-stack: processes bind `::`, workers advertise the bare pod IP (--advertise-host,
    the code adds the port and brackets IPv6); nothing joins $(POD_IP) and a port by string
    concatenation (`10.0.0.1:50051` works, `fd00::1:50051` does not); the Redis and OTLP
    endpoints are Service names, not addresses."""
    problems = []
    for dep in workloads(docs):
        for c in pod_spec(dep).get("containers", []) + pod_spec(dep).get("initContainers", []):
            values = list(c.get("args") or []) + list(c.get("command") or []) + \
                [e.get("value") or "" for e in c.get("env") or []]
            for value in values:
                if _POD_IP_JOINED.search(value):
                    problems.append(f"{name_of(dep)}: {value!r} joins $(POD_IP) and a port as a "
                                    "string (breaks on IPv6): pass --advertise-host=$(POD_IP)")
    for dep, c, role in tandem_containers(docs):
        flags = parse_flags(c["args"][1:])
        if flags.get("host") != DUAL_STACK_HOST:
            problems.append(f"{name_of(dep)}: --host={flags.get('host')!r}; bind "
                            f"{DUAL_STACK_HOST!r} (IPv4 and IPv6)")
        if role in WORKER_ROLES:
            if flags.get("advertise-host") != "$(POD_IP)":
                problems.append(f"{name_of(dep)}: want --advertise-host=$(POD_IP), got "
                                f"{flags.get('advertise-host')!r}")
            if "advertise-address" in flags:
                problems.append(f"{name_of(dep)}: --advertise-address (host:port) is replaced "
                                "by --advertise-host")
            pod_ip = env_var(c, "POD_IP") or {}
            if pod_ip.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
                problems.append(f"{name_of(dep)}: POD_IP must come from the downward API "
                                "(fieldRef status.podIP)")
        env = container_env(c, docs, namespace_of(dep))
        for var in ("REDIS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            host = urlsplit(env.get(var, "")).hostname or ""
            try:
                ipaddress.ip_address(host)
            except ValueError:
                continue
            problems.append(f"{name_of(dep)}: {var} names the address {host}; use the Service name")
    return problems


LOG_LEVELS = ("debug", "info", "warning", "error")


# No policy tool knows this: one log level across Tandem's roles.
def check_log_level(docs: list[Doc]) -> list[str]:
    """One log level for the three roles: TANDEM_LOG_LEVEL from the shared ConfigMap, not
    shadowed by a per-role variable, a container's own env or a --log-level flag."""
    problems = []
    for dep, c, _role in tandem_containers(docs):
        env = container_env(c, docs, namespace_of(dep))
        level = env.get("TANDEM_LOG_LEVEL")
        if level is None or level.lower() not in LOG_LEVELS:
            problems.append(f"{name_of(dep)}: TANDEM_LOG_LEVEL {level!r} is not one of "
                            f"{LOG_LEVELS}")
        if env_var(c, "TANDEM_LOG_LEVEL") is not None:
            problems.append(f"{name_of(dep)}: sets its own TANDEM_LOG_LEVEL; the shared "
                            "ConfigMap's applies to all roles")
        shadows = [k for k in env if re.fullmatch(r"TANDEM_[A-Z]+_LOG_LEVEL", k)]
        if shadows:
            problems.append(f"{name_of(dep)}: {shadows} would shadow TANDEM_LOG_LEVEL")
        if "log-level" in parse_flags(c["args"][1:]):
            problems.append(f"{name_of(dep)}: --log-level overrides TANDEM_LOG_LEVEL")
    return problems


SPREAD_KEYS = ("topology.kubernetes.io/zone", "kubernetes.io/hostname")


# No policy tool knows this: zone spreading per Tandem role.
def check_topology(docs: list[Doc]) -> list[str]:
    """Each role spreads over zones and nodes (soft, so one node or one zone still schedules),
    counting its own pods only: a selector that misses the pod's labels, or counts another
    role's pods too, spreads nothing."""
    problems = []
    roles = role_deployments(docs)
    for role, dep in roles.items():
        labels = pod_labels(dep)
        others = [pod_labels(d) for r, d in roles.items() if r != role]
        constraints = pod_spec(dep).get("topologySpreadConstraints") or []
        for key in SPREAD_KEYS:
            mine = [t for t in constraints if t["topologyKey"] == key]
            if not mine:
                problems.append(f"{name_of(dep)}: no topologySpreadConstraint on {key}")
        for t in constraints:
            where = f"{name_of(dep)}: spread on {t['topologyKey']}"
            if t.get("whenUnsatisfiable") != "ScheduleAnyway":
                problems.append(f"{where} must be ScheduleAnyway (one zone or node still "
                                "schedules)")
            if not t.get("labelSelector") or not selector_matches(t["labelSelector"], labels):
                problems.append(f"{where}: labelSelector does not match the pod's own labels")
            elif any(selector_matches(t["labelSelector"], o) for o in others):
                problems.append(f"{where}: labelSelector also counts another role's pods")
    return problems


def node_requirements(spec: Doc) -> dict[str, set[str]]:
    """Node label -> allowed values, from nodeSelector and required node affinity (In)."""
    req = {k: {v} for k, v in (spec.get("nodeSelector") or {}).items()}
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    if len(terms) == 1:  # several terms are ORed: too loose to count as a requirement
        for expr in terms[0].get("matchExpressions") or []:
            if expr["operator"] == "In":
                req[expr["key"]] = req.get(expr["key"], set(expr["values"])) & set(
                    expr["values"])
    return req


# No policy tool knows this: verifiers and drafts on disjoint GPU classes.
def check_gpu_placement(docs: list[Doc]) -> list[str]:
    """prod-gpu: GPUs for the pools, and drafts and verifiers on different GPU classes."""
    problems = []
    roles = role_deployments(docs)
    reqs = {}
    for role in WORKER_ROLES:
        dep = roles[role]
        spec = pod_spec(dep)
        c = next(c for c in spec["containers"] if (c.get("args") or [None])[0] == role)
        if GPU not in ((c.get("resources") or {}).get("limits") or {}):
            problems.append(f"{name_of(dep)}: no {GPU} limit")
        if not any(t.get("key") == GPU for t in spec.get("tolerations") or []):
            problems.append(f"{name_of(dep)}: no toleration for the {GPU} taint")
        reqs[role] = node_requirements(spec)
        if not reqs[role]:
            problems.append(f"{name_of(dep)}: no node selection")
    shared = set(reqs["verifier"]) & set(reqs["draft"])
    if not any(not (reqs["verifier"][k] & reqs["draft"][k]) for k in shared):
        problems.append(f"verifiers {reqs['verifier']} and drafts {reqs['draft']} may land on "
                        "the same GPU class: they must select disjoint node labels")
    if reqs["verifier"].get(GPU_CLASS_LABEL) != {"large"} or \
            reqs["draft"].get(GPU_CLASS_LABEL) != {"small"}:
        problems.append(f"verifiers want {GPU_CLASS_LABEL}=large, drafts =small")
    gateway = roles["gateway"]
    if GPU in json.dumps(pod_spec(gateway)):
        problems.append("the gateway must not ask for a GPU")
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        if "minAvailable" not in pdb["spec"]:
            problems.append(f"{name_of(pdb)}: production PDBs use minAvailable")
    return problems


def metrics_port(container: Doc, role: str) -> int | None:
    """The port a role's container serves /metrics on (--metrics-port, every role)."""
    value = parse_flags(container.get("args") or []).get("metrics-port")
    return int(value) if value and value.lstrip("-").isdigit() else None


# No policy tool knows this: PodMonitors scrape the port each role serves /metrics on.
def check_pod_monitors(docs: list[Doc]) -> list[str]:
    """Where PodMonitors are shipped: one per role, carrying the selector label, selecting
    exactly that role's pods in their namespace, scraping /metrics on the port the process
    serves it on."""
    monitors = of_kind(docs, "PodMonitor")
    if not monitors:
        return []
    problems = []
    for dep, container, role in tandem_containers(docs):
        mine = [m for m in monitors if namespace_of(m) == namespace_of(dep)
                and selector_matches(m["spec"]["selector"], pod_labels(dep))]
        if len(mine) != 1:
            problems.append(f"{name_of(dep)}: {len(mine)} PodMonitors select its pods")
            continue
        (mon,) = mine
        if POD_MONITOR_SELECTOR_LABEL not in mon["metadata"].get("labels", {}):
            problems.append(f"{name_of(mon)}: no {POD_MONITOR_SELECTOR_LABEL!r} label for "
                            "Prometheus' podMonitorSelector")
        want = metrics_port(container, role)
        for ep in mon["spec"]["podMetricsEndpoints"]:
            got = container_ports(container).get(ep["port"])
            if got is None or got != want:
                problems.append(f"{name_of(mon)}: port {ep['port']!r} is {got}, the {role} "
                                f"serves /metrics on {want}")
            if ep.get("path", "/metrics") != "/metrics":
                problems.append(f"{name_of(mon)}: path {ep['path']!r} is not /metrics")
    return problems


ALL_CHECKS: list[Callable[[list[Doc]], list[str]]] = [
    check_schemas, check_probes_and_resources, check_ports, check_services, check_autoscalers,
    check_network_policies, check_termination, check_readiness, check_env_wiring,
    check_workload_hygiene, check_images, check_secrets, check_addresses, check_log_level,
    check_topology, check_pod_monitors,
]
# What only production must pass (dev runs CPU-only with an ephemeral Redis).
PROD_CHECKS: list[Callable[[list[Doc]], list[str]]] = [check_gpu_placement, check_redis_durable]


def all_problems(docs: list[Doc]) -> list[str]:
    """Every check's problems; a check that trips over a malformed document is one too."""
    problems = []
    for check in ALL_CHECKS:
        try:
            problems += check(docs)
        except (KeyError, TypeError, ValueError, StopIteration) as exc:
            problems.append(f"{check.__name__} could not read the render: {exc!r}")
    return problems


# ------------------------------------------------------------------------- tests: every render

# No policy tool knows this: runs the Tandem checks above on every render.
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_render_passes(target, docs, check):
    if target == "base" and check is check_images:
        pytest.skip("the base leaves the images to the overlays "
                    "(test_base_leaves_images_to_the_overlays)")
    problems = check(docs)
    assert not problems, "\n".join(problems)


# No policy tool knows this: runs the production-only Tandem checks.
@pytest.mark.parametrize("target", PROD_TARGETS)
@pytest.mark.parametrize("check", PROD_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_production_render_passes(target, check):
    problems = check(render(target))
    assert not problems, "\n".join(problems)


# No policy tool knows this: the overlay / image layout.
def test_base_leaves_images_to_the_overlays():
    """Two logical names (gateway; verifier and draft): a layer that mapped both to the same
    repository would leave no overlay able to give them different builds."""
    got = {role: c["image"] for _d, c, role in tandem_containers(render("base"))}
    assert got == LOGICAL_IMAGES


# No policy tool knows this: the gateway's build.
@pytest.mark.parametrize("target", PROD_TARGETS)
def test_production_gateway_runs_the_cpu_image(target):
    docs = render(target)
    images = {role: c["image"] for _d, c, role in tandem_containers(docs)}
    assert "cuda" not in image_tag(images["gateway"]), images
    assert all(image_tag(images[r]).endswith("-cuda") for r in WORKER_ROLES), images
    assert images["gateway"].rpartition(":")[0] == images["verifier"].rpartition(":")[0], \
        "one repository, two builds (tags)"
    assert not requests_gpu(pod_spec(role_deployments(docs)["gateway"]))


# No policy tool knows this: Tandem's API-key settings.
@pytest.mark.parametrize("target", PROD_TARGETS)
def test_production_requires_api_keys_and_ships_no_secrets(target):
    docs = render(target)
    assert not of_kind(docs, "Secret"), "prod overlays ship no secret values: the Secrets " \
        "are created in the cluster (deploy/README.md)"
    gateway = next(c for _d, c, role in tandem_containers(docs) if role == "gateway")
    assert (env_var(gateway, "TANDEM_REQUIRE_API_KEYS") or {}).get("value") == "1"
    assert (env_var(gateway, "TANDEM_API_KEYS_FILE") or {}).get("value")
    assert check_secrets(docs) == []


# No policy tool knows this: a documented variant's contents.
def test_the_external_redis_variant_has_no_in_cluster_redis():
    docs = render("prod-gpu+external-redis")
    assert not redis_workloads(docs)
    assert not [d for d in docs if d["metadata"]["name"] == "tandem-redis"]
    for _dep, c, _role in tandem_containers(docs):
        assert secret_ref(c, "REDIS_URL") == {"name": REDIS_SECRET, "key": "url"}
        assert secret_ref(c, "REDIS_PASSWORD") == {"name": REDIS_SECRET, "key": "password"}


# No policy tool knows this: dev must fail check_redis_durable.
def test_dev_redis_is_not_production_grade():
    """The production check refuses dev's ephemeral Redis (so it can fail)."""
    problems = check_redis_durable(render("dev"))
    assert any("ephemeral" in p for p in problems), problems


# No policy tool knows this: a default in Tandem's code.
def test_the_gateway_default_request_timeout_is_the_one_checked():
    from gateway.config import GatewayConfig

    assert GatewayConfig().request_timeout_s == DEFAULT_REQUEST_TIMEOUT_S


# No policy tool knows this: the tier covers every overlay in the tree.
def test_every_overlay_is_checked():
    assert {"dev", "prod-gpu"} <= set(OVERLAYS), OVERLAYS
    assert any("keda" in o for o in OVERLAYS), "a KEDA overlay renders the ScaledObjects"


# No policy tool knows this: the pieces a Tandem cluster needs.
def test_render_has_every_piece(target, docs):
    kinds = {d["kind"] for d in docs}
    for kind in ("Namespace", "ConfigMap", "ServiceAccount", "Deployment", "Service",
                 "PodDisruptionBudget", "NetworkPolicy"):
        assert kind in kinds, f"no {kind}"
    assert kinds & {"HorizontalPodAutoscaler", "ScaledObject"}, "no autoscaler"
    names = {name_of(d) for d in docs}
    for name in ("Deployment/otel-collector", "Service/otel-collector"):
        assert name in names
    # Redis: the StatefulSet (base, prod), the ephemeral Deployment (dev only), or none (a
    # variant with components/external-redis)
    if target not in VARIANTS:
        want = "Deployment" if target == "dev" else "StatefulSet"
        assert [name_of(d) for d in redis_workloads(docs)] == [f"{want}/tandem-redis"]
        assert "Service/tandem-redis" in names
    assert any(d["kind"] == "ConfigMap" and "collector.yaml" in d.get("data", {})
               for d in docs), "the collector config ConfigMap"
    assert len({namespace_of(d) for d in docs if d["kind"] != "Namespace"}) == 1


# No policy tool knows this: monitoring per Tandem role.
@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("prod-")])
def test_production_ships_pod_monitors_for_every_role(overlay):
    # The Prometheus Operator ignores prometheus.io/* annotations: without PodMonitors the
    # autoscalers' custom metrics would be unknown and read as 0.
    docs = render(overlay)
    assert len(of_kind(docs, "PodMonitor")) == len(ROLES)
    assert check_pod_monitors(docs) == []


# No policy tool knows this: GPU classes per role.
@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("prod-gpu")])
def test_prod_gpu_placement(overlay):
    problems = check_gpu_placement(render(overlay))
    assert not problems, "\n".join(problems)


# No policy tool knows this: what the dev overlay is for.
def test_dev_is_cpu_only_and_small():
    docs = render("dev")
    text = json.dumps(docs)
    assert GPU not in text, "dev must not request GPUs"
    scaled = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert scaled == {d["metadata"]["name"] for d in role_deployments(docs).values()}
    for dep in of_kind(docs, "Deployment"):
        spec = pod_spec(dep)
        # the HPAs (min 1) own the pools' count; the rest run one replica
        assert dep["spec"].get("replicas") == (None if dep["metadata"]["name"] in scaled else 1), \
            name_of(dep)
        assert not spec.get("nodeSelector") and not spec.get("tolerations"), name_of(dep)
        assert not node_requirements(spec), name_of(dep)
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["minReplicas"] == 1, name_of(hpa)
    image = {c["image"] for _d, c, _r in tandem_containers(docs)}
    assert image == {"ghcr.io/tandem/tandem:dev"}


# No policy tool knows this: the KEDA overlay's shape.
def test_keda_overlay_replaces_hpas_for_both_pools():
    keda = [o for o in OVERLAYS if "keda" in o]
    for overlay in keda:
        docs = render(overlay)
        targets = {so["spec"]["scaleTargetRef"]["name"] for so in of_kind(docs, "ScaledObject")}
        roles = role_deployments(docs)
        for role in WORKER_ROLES:
            assert roles[role]["metadata"]["name"] in targets, f"{overlay}: {role}"
        assert not check_gpu_placement(docs), overlay


# Flags the manifests pass that the CLI may not have yet (being added in the same issue); once
# the parser defines one, it is parsed and type-checked like every other flag.
PENDING_FLAGS = {"--metrics-port", "--advertise-host"}
POD_IP_V6 = "fd00:10:244::7"  # a pod IP the args must cope with


# No policy tool knows this: container args against Tandem's CLI parser.
def test_container_args_parse_with_the_real_cli(monkeypatch, target):
    """Every tandem container's args (and TANDEM_* env) are accepted by `tandem`'s parser."""
    from tools.cli import build_parser

    docs = render(target)
    for dep, c, role in tandem_containers(docs):
        env = {k: v for k, v in container_env(c, docs, namespace_of(dep)).items()
               if v != "<valueFrom>"}
        for key in list(os.environ):
            if key.startswith("TANDEM_") or key == "REDIS_URL":
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        values = {**env, "POD_IP": POD_IP_V6, "POD_NAME": f"{role}-0",
                  "POD_NAMESPACE": "tandem"}
        args = [re.sub(r"\$\((\w+)\)", lambda m, v=values: v.get(m.group(1), m.group(0)), a)
                for a in c["args"]]
        assert not any("$(" in a for a in args), f"{name_of(dep)}: unresolved {args}"
        try:
            parsed, unknown = build_parser().parse_known_args(args)
        except SystemExit:
            pytest.fail(f"{target} {name_of(dep)}: `tandem {' '.join(args)}` is rejected")
        unknown_flags = {u.split("=", 1)[0] for u in unknown if u.startswith("--")}
        assert unknown_flags <= PENDING_FLAGS and len(unknown) == len(unknown_flags), \
            f"{target} {name_of(dep)}: unknown arguments {unknown}"
        assert parsed.command == role
        assert parsed.host == DUAL_STACK_HOST
        if hasattr(parsed, "metrics_port"):
            assert isinstance(parsed.metrics_port, int) and parsed.metrics_port != parsed.port
        if role in WORKER_ROLES:
            if hasattr(parsed, "advertise_host"):
                assert parsed.advertise_host == POD_IP_V6
            assert not getattr(parsed, "advertise_address", None)
            assert parsed.drain_grace_s > 0


# No policy tool knows this: preStop commands against Tandem's CLI.
def test_worker_prestop_parses_with_the_real_cli(target):
    """The workers' preStop `tandem drain --sleep N` is a command the image's CLI has."""
    from tools.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    if "drain" not in commands:
        pytest.skip("`tandem drain` is not in the CLI yet (pending, like PENDING_FLAGS)")
    for dep, c, role in tandem_containers(render(target)):
        if role in WORKER_ROLES:
            command = prestop_command(c)
            try:
                parsed = parser.parse_args(command[1:])
            except SystemExit:
                pytest.fail(f"{target} {name_of(dep)}: preStop {command} is rejected")
            assert parsed.command == "drain" and parsed.sleep > 0


# No policy tool knows this: adapter rules for Tandem's metrics.
def test_prometheus_adapter_rules_cover_hpa_metrics():
    values = yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter-values.yaml")
                            .read_text())
    patterns = []
    for rule in values["rules"]["custom"]:
        m = re.search(r'__name__=~?"([^"]+)"', rule["seriesQuery"])
        assert m, rule["seriesQuery"]
        patterns.append(re.compile(f"^(?:{m.group(1)})$"))
    used = set()
    for target in TARGETS:
        for hpa in of_kind(render(target), "HorizontalPodAutoscaler"):
            for m in hpa["spec"]["metrics"]:
                if m["type"] == "Pods":
                    used.add(m["pods"]["metric"]["name"])
    assert used, "no Pods metrics in any HPA"
    uncovered = {u for u in used if not any(p.match(u) for p in patterns)}
    assert not uncovered, f"Prometheus Adapter exposes none of {sorted(uncovered)}"


# ------------------------------------------------------------- tests: files that need no kubectl

@pytest.mark.parametrize("path", [DEPLOY / "otel" / "collector.yaml",
                                  K8S / "overlays" / "dev" / "collector.yaml"],
                         ids=["collector", "dev-collector"])
# No policy tool knows this: the shipped collector config's pipelines.
def test_collector_config_pipelines_are_wired(path):
    cfg = yaml.safe_load(path.read_text())
    otlp = cfg["receivers"]["otlp"]["protocols"]
    assert otlp["grpc"]["endpoint"].endswith(":4317")
    assert otlp["http"]["endpoint"].endswith(":4318")
    assert "batch" in cfg["processors"]
    assert "debug" in cfg["exporters"]
    service = cfg["service"]
    for ext in service.get("extensions", []):
        assert ext in cfg["extensions"], ext
    traces = service["pipelines"]["traces"]
    for section in ("receivers", "processors", "exporters"):
        for item in traces[section]:
            assert item in cfg[section], f"{section}: {item} is not defined"
    assert "batch" in traces["processors"]
    if traces["processors"][0] != "memory_limiter" and "memory_limiter" in traces["processors"]:
        pytest.fail("memory_limiter must come first in the pipeline")
    if path.parent.name == "otel":
        assert "otlp" in traces["exporters"], "production forwards to a backend"


def _final_stage(dockerfile: str) -> str:
    return re.split(r"(?m)^FROM ", dockerfile)[-1]


# No policy tool knows this: entrypoint, install line, torch pin, build context.
@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_dockerfile(flavor):
    path = DEPLOY / "docker" / f"Dockerfile.{flavor}"
    text = path.read_text()
    final = _final_stage(text)
    assert re.search(r'(?m)^ENTRYPOINT \["tandem"\]$', final), "ENTRYPOINT [\"tandem\"]"
    # (a non-root USER: checkov's CKV_DOCKER_3 and CKV_DOCKER_8, test_policies.py)
    if flavor == "cpu":
        assert re.search(r"(?m)^RUN pip install \.$", text)
        assert final.startswith("python:")
    else:
        assert re.search(r'(?m)^RUN pip install .*"\.\[gpu\]"', text)
        assert final.startswith("nvidia/cuda:") and "runtime" in final.splitlines()[0]
    # the torch pin matches pyproject.toml's
    pin = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text())
    arg = re.search(r"(?m)^ARG TORCH_VERSION=(\S+)$", text)
    assert pin and arg and arg.group(1) == pin.group(1), "TORCH_VERSION != pyproject's torch pin"
    ignore = (path.parent / f"{path.name}.dockerignore").read_text().split()
    for entry in (".git", ".venv", "tests"):
        assert entry in ignore, f"{entry} must not enter the build context"


# -------------------------------------------------------------------------- negative tests
# Deliberately broken overlays on top of dev/prod-gpu: each must be caught by its check (and so
# by all_problems), which shows the checks can fail. The control case renders the same way with
# no patch and must pass, so a failure there is a broken mechanism, not a caught mistake.

def _env_patch(role: str, entry: str) -> str:
    """A strategic merge patch on one role's env (merged by name)."""
    return f"""
        - patch: |-
            apiVersion: apps/v1
            kind: Deployment
            metadata: {{name: tandem-{role}}}
            spec:
              template:
                spec:
                  containers:
                    - name: {role}
                      env:
                        - {entry}
        """


_SPREAD_ROLE_LABEL = ("/spec/template/spec/topologySpreadConstraints/{}/labelSelector/matchLabels/"
                      "app.kubernetes.io~1component")

BROKEN = {
    "control": ("dev", None, None),
    "control-prod": ("prod-gpu", None, None),
    "control-external-redis": ("prod-gpu+external-redis", None, None),
    "containerport-mismatch": ("dev", check_ports, """
        - target: {kind: Deployment, name: tandem-draft}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/ports/0/containerPort
              value: 50053
        """),
    "replicas-not-an-integer": ("dev", check_schemas, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: add
              path: /spec/replicas
              value: two
        """),
    "unknown-field": ("dev", check_schemas, """
        - target: {kind: Service, name: tandem-gateway}
          patch: |-
            - op: add
              path: /spec/portz
              value: []
        """),
    "verifier-service-not-headless": ("dev", check_services, """
        - target: {kind: Service, name: tandem-verifier}
          patch: |-
            - op: remove
              path: /spec/clusterIP
        """),
    "verifier-open-to-all": ("dev", check_network_policies, """
        - target: {kind: NetworkPolicy, name: tandem-verifier}
          patch: |-
            - op: add
              path: /spec/ingress/-
              value: {ports: [{protocol: TCP, port: 50051}]}
        """),
    "draft-open-to-gateway": ("dev", check_network_policies, """
        - target: {kind: NetworkPolicy, name: tandem-draft}
          patch: |-
            - op: replace
              path: /spec/ingress/0/from/0/podSelector/matchLabels/app.kubernetes.io~1component
              value: gateway
        """),
    "unknown-hpa-metric": ("dev", check_autoscalers, """
        - target: {kind: HorizontalPodAutoscaler, name: tandem-verifier}
          patch: |-
            - op: replace
              path: /spec/metrics/0/pods/metric/name
              value: tandem_verifier_queue_lenght
        """),
    "hpa-target-missing": ("dev", check_autoscalers, """
        - target: {kind: HorizontalPodAutoscaler, name: tandem-draft}
          patch: |-
            - op: replace
              path: /spec/scaleTargetRef/name
              value: tandem-drafts
        """),
    "grace-shorter-than-drain": ("dev", check_termination, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: replace
              path: /spec/template/spec/terminationGracePeriodSeconds
              value: 20
        """),
    "drafts-on-verifier-gpus": ("prod-gpu", check_gpu_placement, """
        - target: {kind: Deployment, name: tandem-draft}
          patch: |-
            - op: replace
              path: /spec/template/spec/nodeSelector/tandem.dev~1gpu-class
              value: large
        """),
    "redis-url-to-nowhere": ("dev", check_env_wiring, """
        - target: {kind: Service, name: tandem-redis}
          patch: |-
            - op: replace
              path: /metadata/name
              value: redis-renamed
        """),
    "podmonitor-wrong-port": ("prod-gpu", check_pod_monitors, """
        - target: {kind: PodMonitor, name: tandem-verifier}
          patch: |-
            - op: replace
              path: /spec/podMetricsEndpoints/0/port
              value: grpc
        """),
    "podmonitor-selects-nothing": ("prod-gpu", check_pod_monitors, """
        - target: {kind: PodMonitor, name: tandem-draft}
          patch: |-
            - op: replace
              path: /spec/selector/matchLabels/app.kubernetes.io~1component
              value: drafts
        """),
    "keda-bad-trigger": ("prod-gpu-keda", check_schemas, """
        - target: {kind: ScaledObject, name: tandem-draft}
          patch: |-
            - op: replace
              path: /spec/triggers/0/metadata/threshold
              value: 4
        """),
    # replicas owned by the autoscaler
    "hpa-target-sets-replicas": ("prod-gpu", check_autoscalers, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: add
              path: /spec/replicas
              value: 2
        """),
    "keda-target-sets-replicas": ("prod-gpu-keda", check_autoscalers, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: add
              path: /spec/replicas
              value: 3
        """),
    # gateway metrics off the public port
    "gateway-metrics-on-public-service": ("dev", check_services, """
        - target: {kind: Service, name: tandem-gateway}
          patch: |-
            - op: add
              path: /spec/ports/-
              value: {name: metrics, port: 9092, targetPort: metrics}
        """),
    "gateway-metrics-open-to-all": ("dev", check_network_policies, """
        - target: {kind: NetworkPolicy, name: tandem-gateway}
          patch: |-
            - op: add
              path: /spec/ingress/-
              value: {ports: [{protocol: TCP, port: 9092}]}
        """),
    "podmonitor-gateway-on-api-port": ("prod-gpu", check_pod_monitors, """
        - target: {kind: PodMonitor, name: tandem-gateway}
          patch: |-
            - op: replace
              path: /spec/podMetricsEndpoints/0/port
              value: http
        """),
    # drain
    "gateway-grace-shorter-than-requests": ("dev", check_termination, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: replace
              path: /spec/template/spec/terminationGracePeriodSeconds
              value: 30
        """),
    "gateway-shutdown-grace-below-timeout": ("dev", check_termination, _env_patch(
        "gateway", "{name: TANDEM_GATEWAY_SHUTDOWN_GRACE_S, value: '30'}")),
    "worker-prestop-plain-sleep": ("dev", check_termination, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/lifecycle/preStop/exec/command
              value: [sleep, "5"]
        """),
    "worker-entrypoint-replaced": ("dev", check_termination, """
        - target: {kind: Deployment, name: tandem-draft}
          patch: |-
            - op: add
              path: /spec/template/spec/containers/0/command
              value: [/bin/sh, -c, exec tandem "$@", --]
        """),
    "readiness-without-service-name": ("dev", check_readiness, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: remove
              path: /spec/template/spec/containers/0/readinessProbe/grpc/service
        """),
    # addresses
    "advertise-address-concatenated": ("dev", check_addresses, """
        - target: {kind: Deployment, name: tandem-draft}
          patch: |-
            - op: add
              path: /spec/template/spec/containers/0/args/-
              value: --advertise-address=$(POD_IP):50052
        """),
    "ipv4-only-bind": ("dev", check_addresses, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/args/1
              value: --host=0.0.0.0
        """),
    # secrets
    "password-in-configmap": ("dev", check_secrets, """
        - target: {kind: ConfigMap, name: tandem-config}
          patch: |-
            - op: add
              path: /data/REDIS_PASSWORD
              value: hunter2
        """),
    "credentials-in-redis-url": ("dev", check_secrets, """
        - target: {kind: ConfigMap, name: tandem-config}
          patch: |-
            - op: replace
              path: /data/REDIS_URL
              value: redis://default:hunter2@tandem-redis:6379/0
        """),
    "redis-password-literal": ("dev", check_secrets, _env_patch(
        "verifier", "{name: REDIS_PASSWORD, value: hunter2, valueFrom: null}")),
    "api-keys-in-env": ("prod-gpu", check_secrets, _env_patch(
        "gateway", "{name: TANDEM_API_KEYS, value: sk-plain-key}")),
    "api-keys-file-from-another-secret": ("prod-gpu", check_secrets, """
        - patch: |-
            apiVersion: apps/v1
            kind: Deployment
            metadata: {name: tandem-gateway}
            spec:
              template:
                spec:
                  volumes:
                    - {name: api-keys, secret: {secretName: tandem-tls}}
        """),
    "redis-without-requirepass": ("prod-gpu", check_secrets, """
        - target: {kind: StatefulSet, name: tandem-redis}
          patch: |-
            - op: remove
              path: /spec/template/spec/containers/0/args/6
            - op: remove
              path: /spec/template/spec/containers/0/args/6
        """),
    # production Redis
    "redis-without-aof": ("prod-gpu", check_redis_durable, """
        - target: {kind: StatefulSet, name: tandem-redis}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/args/1
              value: "no"
        """),
    "redis-without-volume": ("prod-gpu", check_redis_durable, """
        - target: {kind: StatefulSet, name: tandem-redis}
          patch: |-
            - op: remove
              path: /spec/volumeClaimTemplates
        """),
    "external-redis-url-not-from-secret": ("prod-gpu+external-redis", check_redis_durable,
                                          _env_patch("draft", "{name: REDIS_URL, $patch: delete}")),
    # log level, spreading, images
    "log-level-shadowed": ("dev", check_log_level, _env_patch(
        "draft", "{name: TANDEM_DRAFT_LOG_LEVEL, value: warning}")),
    "spread-counts-every-role": ("dev", check_topology, f"""
        - target: {{kind: Deployment, name: tandem-draft}}
          patch: |-
            - op: remove
              path: {_SPREAD_ROLE_LABEL.format(1)}
        """),
    "spread-selects-another-role": ("dev", check_topology, f"""
        - target: {{kind: Deployment, name: tandem-verifier}}
          patch: |-
            - op: replace
              path: {_SPREAD_ROLE_LABEL.format(0)}
              value: draft
        """),
    "no-zone-spread": ("dev", check_topology, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: remove
              path: /spec/template/spec/topologySpreadConstraints/0
        """),
    "gateway-on-the-cuda-image": ("prod-gpu", check_images, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: replace
              path: /spec/template/spec/containers/0/image
              value: ghcr.io/tandem/tandem:0.1.0-cuda
        """),
    "gateway-wants-a-gpu": ("prod-gpu", check_images, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: add
              path: /spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu
              value: 1
        """),
}


def render_broken(tmp_path: Path, base_overlay: str, patches: str | None) -> list[Doc]:
    """An overlay (or a VARIANTS name) with patches on top, rendered."""
    overlay, components = VARIANTS.get(base_overlay, (base_overlay, ()))
    return render_dir(write_overlay(tmp_path / "broken", overlay, patches, components))


# No policy tool knows this: each Tandem check can fail.
@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_manifest_is_caught(tmp_path, case):
    base_overlay, check, patches = BROKEN[case]
    docs = render_broken(tmp_path, base_overlay, patches)
    problems = all_problems(docs)
    if check is None:
        assert not problems, "the unpatched temp overlay must pass:\n" + "\n".join(problems)
        if base_overlay != "dev":
            assert not [p for c in PROD_CHECKS for p in c(docs)], case
        return
    caught = check(docs)
    assert caught, f"{check.__name__} missed the broken manifest ({case})"
    if check not in PROD_CHECKS:
        assert problems, case


# No policy tool knows this: our cached validator.
def test_schema_validation_agrees_with_kubernetes_validate():
    """Our cached validator finds what kubernetes_validate.validate finds."""
    good = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}},
                     "template": {"metadata": {"labels": {"a": "b"}},
                                  "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    bad = json.loads(json.dumps(good))
    bad["spec"]["replicas"] = "two"
    kubernetes_validate.validate(good, KUBE_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)
    assert schema_problems(good) == []
    assert any("spec.replicas" in p for p in schema_problems(bad))
    typo = json.loads(json.dumps(good))
    typo["spec"]["replica"] = 1
    assert schema_problems(typo), "strict schemas reject unknown fields"
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert "no schema" in schema_problems(unknown)[0]


# No policy tool knows this: a unit test of this file's helpers.
def test_quantity_and_selector_helpers():
    assert quantity("500m") == Fraction(1, 2)
    assert quantity("2Gi") == 2 * 2**30 and quantity(1) == 1
    assert quantity("1536Mi") > quantity("1Gi")
    with pytest.raises(ValueError):
        quantity("two")
    labels = {"a": "1", "b": "2"}
    assert selector_matches({}, labels)
    assert selector_matches({"matchExpressions": [{"key": "a", "operator": "In",
                                                   "values": ["1", "3"]}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "c", "operator": "Exists"}]},
                                labels)
    assert parse_flags(["--port=1", "--host", "0.0.0.0", "--x"]) == {
        "port": "1", "host": "0.0.0.0", "x": ""}


# No policy tool knows this: the dashboard ConfigMap vs its JSON.
def test_grafana_dashboard_configmap_carries_the_dashboard():
    docs = render_dir(DEPLOY / "monitoring")
    assert check_schemas(docs) == []
    maps = [d for d in of_kind(docs, "ConfigMap")
            if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(maps) == 1, "one ConfigMap for Grafana's dashboard sidecar"
    (body,) = maps[0]["data"].values()
    assert json.loads(body) == json.loads((DEPLOY / "monitoring/grafana-dashboard.json")
                                          .read_text())
