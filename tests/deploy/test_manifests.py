"""Deploy tier: render every kustomize overlay and check it offline.

Each overlay under deploy/k8s/overlays (and the base) is rendered with `kubectl kustomize`, and
every document is validated against the Kubernetes OpenAPI JSON schemas bundled in the
`kubernetes-validate` package (strict: unknown fields fail) for one Kubernetes version. CRDs the
bundle does not know (KEDA's ScaledObject) get a structural schema of our own that reuses the
bundled definitions where it can (the HPA behavior block).

Then the things a schema cannot see: probes and resources on every container, ports that agree
between the `tandem` flags, containerPorts, probes and Services, headless worker Services,
autoscalers that target existing Deployments on the metrics the workers export, node classes
that keep drafts and verifiers on different GPU types, NetworkPolicies that let only the gateway
reach verifiers and only verifiers reach drafts, termination grace longer than the drain, and
the OpenTelemetry wiring. Negative tests render deliberately broken overlays and require the
checks to catch them.

Needs `kubectl` (skipped cleanly without it) and the dev extra (kubernetes-validate, PyYAML).
Offline; a few seconds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
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
GPU = "nvidia.com/gpu"
GPU_CLASS_LABEL = "tandem.dev/gpu-class"

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir()
                  if (p / "kustomization.yaml").is_file())
TARGETS = ["base", *OVERLAYS]  # every render the tier checks

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


@cache
def _render_cached(target: str) -> tuple[str, ...]:
    # cached as JSON text so every test gets its own copy to inspect
    return tuple(json.dumps(d) for d in render_dir(target_dir(target)))


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
    return f"{doc['kind']}/{doc['metadata']['name']}"


def of_kind(docs: Iterable[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def find(docs: Iterable[Doc], kind: str, name: str) -> Doc | None:
    return next((d for d in docs if d.get("kind") == kind and d["metadata"]["name"] == name),
                None)


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
    for dep in of_kind(docs, "Deployment"):
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


def prestop_sleep_s(container: Doc) -> float:
    pre = ((container.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = (pre.get("exec") or {}).get("command") or []
    if len(cmd) == 2 and cmd[0].endswith("sleep"):
        return float(cmd[1])
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
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT_SCHEMA,
               ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SCHEMA}
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


def check_schemas(docs: list[Doc]) -> list[str]:
    """Every document against the Kubernetes schemas (strict), CRDs against ours."""
    return [p for doc in docs for p in schema_problems(doc)]


def check_probes_and_resources(docs: list[Doc]) -> list[str]:
    problems = []
    for dep in of_kind(docs, "Deployment"):
        inits = pod_spec(dep).get("initContainers", [])
        for c in inits + pod_spec(dep)["containers"]:
            where = f"{name_of(dep)} container {c['name']}"
            if c not in inits:
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe not in c:
                        problems.append(f"{where}: no {probe}")
                    elif probe_port(c[probe], c) is None and "exec" not in c[probe]:
                        problems.append(f"{where}: {probe} has no resolvable port")
            res = c.get("resources") or {}
            requests, limits = res.get("requests") or {}, res.get("limits") or {}
            for kind in ("cpu", "memory"):
                if kind not in requests:
                    problems.append(f"{where}: no {kind} request")
                if kind not in limits:
                    problems.append(f"{where}: no {kind} limit")
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
        if flags.get("host") not in ("0.0.0.0", "[::]", "::"):
            problems.append(f"{where}: --host must bind all interfaces in a pod, "
                            f"not {flags.get('host')!r}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c and probe_port(c[probe], c) != port:
                problems.append(f"{where}: {probe} port {probe_port(c[probe], c)} != --port "
                                f"{port}")
        metrics_port = port
        if role in WORKER_ROLES:
            if "metrics-port" not in flags:
                problems.append(f"{where}: no --metrics-port")
            else:
                metrics_port = int(flags["metrics-port"])
                if metrics_port not in declared:
                    problems.append(f"{where}: --metrics-port {metrics_port} is not a "
                                    "containerPort")
            advertise = flags.get("advertise-address", "")
            if advertise != f"$(POD_IP):{port}":
                problems.append(f"{where}: --advertise-address {advertise!r} should be "
                                f"$(POD_IP):{port}")
            pod_ip = next((e for e in c.get("env", []) if e["name"] == "POD_IP"), None)
            if not pod_ip or pod_ip.get("valueFrom", {}).get("fieldRef", {}).get(
                    "fieldPath") != "status.podIP":
                problems.append(f"{where}: POD_IP must come from the downward API "
                                "(fieldRef status.podIP)")
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
        selected = [d for d in of_kind(docs, "Deployment") if svc in services_selecting(docs, d)]
        if not selected:
            problems.append(f"{name_of(svc)}: selects no Deployment's pods")
            continue
        for sp in svc["spec"]["ports"]:
            ok = any(resolve_port(sp.get("targetPort", sp["port"]), c)
                     in {p["containerPort"] for p in c.get("ports", [])}
                     for d in selected for c in pod_spec(d)["containers"])
            if not ok:
                problems.append(f"{name_of(svc)} port {sp.get('name')}: targetPort "
                                f"{sp.get('targetPort')!r} matches no containerPort")
    return problems


def check_services(docs: list[Doc]) -> list[str]:
    """Worker pools behind headless Services (HTTP/2 pins connections); the gateway ClusterIP."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        for svc in services_selecting(docs, dep):
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


def check_autoscalers(docs: list[Doc]) -> list[str]:
    problems = []
    roles = role_deployments(docs)
    role_of = {dep["metadata"]["name"]: role for role, dep in roles.items()}
    scalers = of_kind(docs, "HorizontalPodAutoscaler") + of_kind(docs, "ScaledObject")
    targeted: dict[str, list[str]] = {}
    for doc in scalers:
        ref = doc["spec"]["scaleTargetRef"]
        target = find(docs, ref.get("kind", "Deployment"), ref["name"])
        if ref.get("kind", "Deployment") != "Deployment" or target is None or \
                namespace_of(target) != namespace_of(doc):
            problems.append(f"{name_of(doc)}: scaleTargetRef {ref.get('kind')}/{ref['name']} "
                            "is not a Deployment in this render")
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
        elif isinstance(target["spec"].get("replicas"), int) and \
                not lo <= target["spec"]["replicas"] <= hi:
            problems.append(f"{name_of(target)}: replicas {target['spec']['replicas']} outside "
                            f"its autoscaler's {lo}..{hi}")
        behavior = spec.get("behavior") if doc["kind"] == "HorizontalPodAutoscaler" else \
            ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get(
                "behavior")
        if role in WORKER_ROLES and not (behavior and "scaleUp" in behavior
                                         and "scaleDown" in behavior):
            problems.append(f"{name_of(doc)}: pools need explicit scaleUp and scaleDown behavior")
    for name, owners in targeted.items():
        if len(owners) > 1:
            problems.append(f"Deployment/{name} has {len(owners)} autoscalers {owners}: they "
                            "would fight")
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
    for dep in of_kind(docs, "Deployment"):
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
        *[(role, metrics[role], {"prometheus"}) for role in WORKER_ROLES if metrics.get(role)],
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


def check_termination(docs: list[Doc]) -> list[str]:
    """Grace period > preStop sleep + registry leave + drain grace, for every tandem pod."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        grace = pod_spec(dep).get("terminationGracePeriodSeconds", 30)
        sleep = prestop_sleep_s(c)
        if sleep <= 0:
            problems.append(f"{name_of(dep)}: no preStop sleep (endpoints must drop the pod "
                            "before SIGTERM)")
        need = sleep
        if role in WORKER_ROLES:
            flags = parse_flags(c["args"][1:])
            env_name = f"TANDEM_{role.upper()}_DRAIN_GRACE_S"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            drain = float(flags.get("drain-grace-s", env.get(env_name) or DEFAULT_DRAIN_GRACE_S))
            need += REGISTRY_LEAVE_S + drain
        if not grace > need:
            problems.append(f"{name_of(dep)}: terminationGracePeriodSeconds {grace} must exceed "
                            f"{need:g} s (preStop sleep + drain)")
    return problems


# The collector's standard ports per OTLP transport, for every protocol tandem.telemetry exports.
OTLP_PORTS = MappingProxyType({"grpc": 4317, "http/protobuf": 4318})


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


def check_workload_hygiene(docs: list[Doc]) -> list[str]:
    """ServiceAccount per role, non-root, one pinned image, a PDB per pool."""
    problems = []
    accounts = set()
    images = set()
    for dep, c, _role in tandem_containers(docs):
        spec = pod_spec(dep)
        sa = spec.get("serviceAccountName")
        if not sa or find(docs, "ServiceAccount", sa) is None:
            problems.append(f"{name_of(dep)}: ServiceAccount {sa!r} not in the render")
        accounts.add(sa)
        if not (spec.get("securityContext") or {}).get("runAsNonRoot"):
            problems.append(f"{name_of(dep)}: pod must set runAsNonRoot")
        if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name_of(dep)}: allowPrivilegeEscalation must be false")
        images.add(c["image"])
        pdbs = [p for p in of_kind(docs, "PodDisruptionBudget")
                if selector_matches(p["spec"].get("selector"), pod_labels(dep))]
        if len(pdbs) != 1:
            problems.append(f"{name_of(dep)}: {len(pdbs)} PodDisruptionBudgets select it, "
                            "want 1")
    if len(accounts) != len(tandem_containers(docs)):
        problems.append("each role needs its own ServiceAccount")
    if len(images) != 1:
        problems.append(f"one image for all roles, got {sorted(images)}")
    for image in images:
        repo, _, tag = image.rpartition(":")
        if "/" in tag or not repo or tag in ("", "latest"):
            problems.append(f"image {image!r} must carry a pinned tag (kustomize images:)")
    missing = set(ROLES) - set(role_deployments(docs))
    if missing:
        problems.append(f"no Deployment for {sorted(missing)}")
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
    """The port a role's container serves /metrics on (the gateway: its HTTP port)."""
    flags = parse_flags(container.get("args") or [])
    value = flags.get("port" if role == "gateway" else "metrics-port")
    return int(value) if value and value.lstrip("-").isdigit() else None


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
    check_network_policies, check_termination, check_env_wiring, check_workload_hygiene,
    check_pod_monitors,
]


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

@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_render_passes(docs, check):
    problems = check(docs)
    assert not problems, "\n".join(problems)


def test_every_overlay_is_checked():
    assert {"dev", "prod-gpu"} <= set(OVERLAYS), OVERLAYS
    assert any("keda" in o for o in OVERLAYS), "a KEDA overlay renders the ScaledObjects"


def test_render_has_every_piece(docs):
    kinds = {d["kind"] for d in docs}
    for kind in ("Namespace", "ConfigMap", "ServiceAccount", "Deployment", "Service",
                 "PodDisruptionBudget", "NetworkPolicy"):
        assert kind in kinds, f"no {kind}"
    assert kinds & {"HorizontalPodAutoscaler", "ScaledObject"}, "no autoscaler"
    names = {name_of(d) for d in docs}
    for name in ("Deployment/tandem-redis", "Service/tandem-redis", "Deployment/otel-collector",
                 "Service/otel-collector"):
        assert name in names
    assert any(d["kind"] == "ConfigMap" and "collector.yaml" in d.get("data", {})
               for d in docs), "the collector config ConfigMap"
    assert len({namespace_of(d) for d in docs if d["kind"] != "Namespace"}) == 1


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("prod-")])
def test_production_ships_pod_monitors_for_every_role(overlay):
    # The Prometheus Operator ignores prometheus.io/* annotations: without PodMonitors the
    # autoscalers' custom metrics would be unknown and read as 0.
    docs = render(overlay)
    assert len(of_kind(docs, "PodMonitor")) == len(ROLES)
    assert check_pod_monitors(docs) == []


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("prod-gpu")])
def test_prod_gpu_placement(overlay):
    problems = check_gpu_placement(render(overlay))
    assert not problems, "\n".join(problems)


def test_dev_is_cpu_only_and_small():
    docs = render("dev")
    text = json.dumps(docs)
    assert GPU not in text, "dev must not request GPUs"
    for dep in of_kind(docs, "Deployment"):
        spec = pod_spec(dep)
        assert dep["spec"]["replicas"] == 1, name_of(dep)
        assert not spec.get("nodeSelector") and not spec.get("tolerations"), name_of(dep)
        assert not node_requirements(spec), name_of(dep)
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["minReplicas"] == 1, name_of(hpa)
    image = {c["image"] for _d, c, _r in tandem_containers(docs)}
    assert image == {"ghcr.io/tandem/tandem:dev"}


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
PENDING_FLAGS = {"--metrics-port"}


def test_container_args_parse_with_the_real_cli(monkeypatch, target):
    """Every tandem container's args (and TANDEM_* env) are accepted by `tandem`'s parser."""
    from tandem.cli import build_parser

    docs = render(target)
    for dep, c, role in tandem_containers(docs):
        env = {k: v for k, v in container_env(c, docs, namespace_of(dep)).items()
               if v != "<valueFrom>"}
        for key in list(os.environ):
            if key.startswith("TANDEM_") or key == "REDIS_URL":
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        values = {**env, "POD_IP": "10.1.2.3", "POD_NAME": f"{role}-0",
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
        assert parsed.host == "0.0.0.0"
        if role in WORKER_ROLES:
            assert parsed.advertise_address == f"10.1.2.3:{parsed.port}"
            assert parsed.drain_grace_s > 0


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


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_dockerfile(flavor):
    path = DEPLOY / "docker" / f"Dockerfile.{flavor}"
    text = path.read_text()
    final = _final_stage(text)
    assert re.search(r'(?m)^ENTRYPOINT \["tandem"\]$', final), "ENTRYPOINT [\"tandem\"]"
    users = re.findall(r"(?m)^USER (\S+)", final)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as non-root"
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

BROKEN = {
    "control": ("dev", None, None),
    "no-readiness-probe": ("dev", check_probes_and_resources, """
        - target: {kind: Deployment, name: tandem-verifier}
          patch: |-
            - op: remove
              path: /spec/template/spec/containers/0/readinessProbe
        """),
    "no-memory-limit": ("dev", check_probes_and_resources, """
        - target: {kind: Deployment, name: tandem-gateway}
          patch: |-
            - op: remove
              path: /spec/template/spec/containers/0/resources/limits/memory
        """),
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
            - op: replace
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
}


def render_broken(tmp_path: Path, base_overlay: str, patches: str | None) -> list[Doc]:
    overlay = tmp_path / "broken"
    overlay.mkdir()
    rel = os.path.relpath(K8S / "overlays" / base_overlay, overlay)  # kustomize wants relative
    text = f"resources:\n  - {rel}\n"
    if patches:
        text += "patches:\n" + textwrap.indent(textwrap.dedent(patches).strip("\n"), "  ") + "\n"
    (overlay / "kustomization.yaml").write_text(text)
    return render_dir(overlay)


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_manifest_is_caught(tmp_path, case):
    base_overlay, check, patches = BROKEN[case]
    docs = render_broken(tmp_path, base_overlay, patches)
    problems = all_problems(docs)
    if check is None:
        assert not problems, "the unpatched temp overlay must pass:\n" + "\n".join(problems)
        return
    caught = check(docs)
    assert caught, f"{check.__name__} missed the broken manifest ({case})"
    if check is not check_gpu_placement:
        assert problems, case


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


def test_grafana_dashboard_configmap_carries_the_dashboard():
    docs = render_dir(DEPLOY / "monitoring")
    assert check_schemas(docs) == []
    maps = [d for d in of_kind(docs, "ConfigMap")
            if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(maps) == 1, "one ConfigMap for Grafana's dashboard sidecar"
    (body,) = maps[0]["data"].values()
    assert json.loads(body) == json.loads((DEPLOY / "monitoring/grafana-dashboard.json")
                                          .read_text())
