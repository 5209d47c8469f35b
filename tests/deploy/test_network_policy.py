"""No internal port is reachable from outside the namespace, in every rendered overlay.

test_manifests.py evaluates the policies against a few stand-in pods; this reads the rendered
NetworkPolicies themselves, so a rule admitting a namespace or address no stand-in lives in is
caught too. For every pod of the render (verifier, draft, gateway, Redis, the collector):

- some NetworkPolicy in its namespace with policyTypes Ingress selects it (else it is open);
- every ingress rule of those policies admits only pods of the same namespace: a podSelector
  without a namespaceSelector, or a namespaceSelector that matches only that namespace by name.
  Two exceptions: the gateway's public port may admit anyone, and a worker's metrics port
  (--metrics-port) may admit the monitoring namespace, where Prometheus runs.

Negative tests mutate the rendered policies and require the check to catch each one.
"""
from __future__ import annotations

import copy

import pytest
from test_manifests import (
    TARGETS,
    WORKER_ROLES,
    Doc,
    find,
    name_of,
    namespace_of,
    of_kind,
    parse_flags,
    pod_labels,
    pod_spec,
    render,
    resolve_port,
    selector_matches,
)

pytestmark = pytest.mark.deploy

MONITORING_NAMESPACES = frozenset({"monitoring"})
NS_NAME = "kubernetes.io/metadata.name"  # the label every namespace carries (Kubernetes 1.22+)


def ingress_policies(docs: list[Doc], ns: str, labels: dict[str, str]) -> list[Doc]:
    """Policies isolating these pods for ingress (policyTypes absent = Ingress)."""
    return [p for p in of_kind(docs, "NetworkPolicy")
            if namespace_of(p) == ns and selector_matches(p["spec"].get("podSelector"), labels)
            and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])]


def namespaces_named(selector: Doc) -> frozenset[str] | None:
    """The namespaces a namespaceSelector can match, by name; None = not pinned to names (it
    selects by other labels, which any namespace may carry)."""
    names: frozenset[str] | None = None
    pinned = (selector.get("matchLabels") or {}).get(NS_NAME)
    if pinned is not None:
        names = frozenset({pinned})
    for expr in selector.get("matchExpressions") or []:
        if expr.get("key") == NS_NAME and expr.get("operator") == "In":
            values = frozenset(expr.get("values") or ())
            names = values if names is None else names & values
    return names


def peer_scope(peer: Doc, ns: str) -> str:
    """'namespace', 'monitoring' or 'outside': where the sources a peer admits may live."""
    if "ipBlock" in peer:  # addresses: outside the cluster, or any pod
        return "outside"
    if "namespaceSelector" not in peer:
        return "namespace"  # a podSelector alone means this namespace
    names = namespaces_named(peer["namespaceSelector"])
    if names is not None and names <= {ns}:
        return "namespace"
    if names is not None and names <= {ns} | MONITORING_NAMESPACES:
        return "monitoring"
    return "outside"


def rule_ports(rule: Doc, containers: list[Doc]) -> set[int] | None:
    """The pod's ports a rule opens; None = every port. Any protocol counts."""
    ports: set[int] = set()
    for rp in rule.get("ports") or []:
        if "port" not in rp:
            return None
        if isinstance(rp["port"], int):
            start = rp["port"]
        else:  # a named port matches nothing on a pod that has no port of that name
            start = next((p for c in containers
                          if (p := resolve_port(rp["port"], c)) is not None), None)
        if start is not None:
            ports.update(range(start, rp.get("endPort", start) + 1))
    return ports if rule.get("ports") else None


def _open_ports(labels: dict[str, str], containers: list[Doc]) -> tuple[set[int], set[int]]:
    """(ports open to anyone, ports open to the monitoring namespace) for these pods."""
    role = labels.get("app.kubernetes.io/component") \
        if labels.get("app.kubernetes.io/name") == "tandem" else None
    public, monitored = set(), set()
    for c in containers:
        args = c.get("args") or []
        if role is None or not args or args[0] != role:
            continue
        flags = parse_flags(args[1:])
        if role == "gateway":
            public.add(int(flags["port"]))
        elif role in WORKER_ROLES and flags.get("metrics-port"):
            monitored.add(int(flags["metrics-port"]))
    return public, monitored


def pod_exposure(docs: list[Doc], deploy: Doc) -> list[str]:
    """What admits sources from outside the namespace to this Deployment's pods, wrongly."""
    ns, labels = namespace_of(deploy), pod_labels(deploy)
    containers = pod_spec(deploy)["containers"]
    who = name_of(deploy)
    policies = ingress_policies(docs, ns, labels)
    if not policies:
        return [f"{who}: no ingress NetworkPolicy selects its pods: every port is open"]
    public, monitored = _open_ports(labels, containers)
    allowed = {"outside": public, "monitoring": public | monitored}
    problems = []
    for pol in policies:
        for i, rule in enumerate(pol["spec"].get("ingress") or []):
            peers = rule.get("from") or []
            scopes = {peer_scope(p, ns) for p in peers} if peers else {"outside"}
            ports = rule_ports(rule, containers)
            for scope in sorted(scopes - {"namespace"}):
                if ports is None or not ports <= allowed[scope]:
                    shown = "every port" if ports is None else sorted(ports)
                    problems.append(f"{name_of(pol)} ingress[{i}] admits {scope} sources to "
                                    f"{who} on {shown}; allowed: {sorted(allowed[scope])}")
    return problems


def check_namespace_isolation(docs: list[Doc]) -> list[str]:
    problems = []
    deployments = of_kind(docs, "Deployment")
    components = {pod_labels(d).get("app.kubernetes.io/component") for d in deployments}
    problems += [f"no {role} Deployment in the render" for role in (*WORKER_ROLES, "gateway")
                 if role not in components]
    for dep in deployments:
        problems += pod_exposure(docs, dep)
    return problems


# ------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("target", TARGETS)
def test_internal_ports_are_closed_to_other_namespaces(target):
    problems = check_namespace_isolation(render(target))
    assert not problems, "\n".join(problems)


def _policy(docs: list[Doc], name: str) -> Doc:
    pol = find(docs, "NetworkPolicy", name)
    assert pol is not None, name
    return pol


def _add_rule(name: str, rule: Doc):
    return lambda docs: _policy(docs, name)["spec"]["ingress"].append(rule)


def _set_peer(name: str, rule: int, peer: Doc):
    def mutate(docs):
        _policy(docs, name)["spec"]["ingress"][rule]["from"] = [peer]
    return mutate


def _drop(*names: str):
    def mutate(docs):
        docs[:] = [d for d in docs if not (d["kind"] == "NetworkPolicy"
                                           and d["metadata"]["name"] in names)]
    return mutate


def _ns(*names: str) -> Doc:
    return {"namespaceSelector": {"matchExpressions": [
        {"key": NS_NAME, "operator": "In", "values": list(names)}]}}


ANY_NAMESPACE = {"namespaceSelector": {}}
MONITORING = {"namespaceSelector": {"matchLabels": {NS_NAME: "monitoring"}}}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}

BROKEN = {
    "verifier-allow-all": _add_rule("tandem-verifier", {}),
    "verifier-grpc-from-any-namespace": _set_peer("tandem-verifier", 0, ANY_NAMESPACE),
    "verifier-grpc-from-the-internet": _set_peer("tandem-verifier", 0,
                                                 {"ipBlock": {"cidr": "0.0.0.0/0"}}),
    "draft-grpc-from-another-namespace": _set_peer("tandem-draft", 0, _ns("tandem", "other")),
    "draft-grpc-from-monitoring": _set_peer("tandem-draft", 0, MONITORING),
    "draft-from-a-namespace-label": _set_peer(
        "tandem-draft", 0, {"namespaceSelector": {"matchLabels": {"team": "ml"}}}),
    "metrics-from-any-namespace": _set_peer("tandem-verifier", 1,
                                            {**ANY_NAMESPACE, "podSelector": {
                                                "matchLabels": PROMETHEUS}}),
    "monitoring-on-every-port": _add_rule("tandem-draft", {"from": [MONITORING]}),
    "verifier-port-range-open": _add_rule("tandem-verifier", {"ports": [
        {"protocol": "TCP", "port": 9000, "endPort": 9100}]}),
    "gateway-open-on-every-port": lambda docs: _policy(docs, "tandem-gateway")["spec"][
        "ingress"][0].pop("ports"),
    "gateway-open-on-a-second-port": _add_rule("tandem-gateway", {"ports": [{"port": 9999}]}),
    "redis-from-anywhere": _add_rule("tandem-redis", {"from": [ANY_NAMESPACE]}),
    "no-policy-selects-the-verifier": _drop("default-deny-ingress", "tandem-verifier"),
    "verifier-policies-egress-only": lambda docs: [
        p["spec"].update(policyTypes=["Egress"]) for p in of_kind(docs, "NetworkPolicy")],
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_opened_policy_is_caught(case):
    docs = render("dev")
    assert not check_namespace_isolation(docs)
    BROKEN[case](docs)
    assert check_namespace_isolation(docs), f"missed: {case}"


@pytest.mark.parametrize("peer", [
    {"podSelector": {}},  # every pod, but of this namespace
    {"namespaceSelector": {"matchLabels": {NS_NAME: "tandem"}}, "podSelector": {}},
    _ns("tandem"),
])
def test_same_namespace_peers_pass(peer):
    docs = render("dev")
    _add_rule("tandem-verifier", {"from": [peer]})(docs)
    assert not check_namespace_isolation(docs)


def test_the_monitoring_namespace_may_scrape_metrics_only():
    docs = render("prod-gpu")
    before = copy.deepcopy(docs)
    _add_rule("tandem-draft", {"from": [MONITORING], "ports": [{"port": 9091}]})(docs)
    assert not check_namespace_isolation(docs)
    _add_rule("tandem-draft", {"from": [MONITORING], "ports": [{"port": 50052}]})(before)
    assert any("monitoring sources" in p and "[50052]" in p
               for p in check_namespace_isolation(before))


def test_namespace_selector_reading():
    assert namespaces_named({}) is None
    assert namespaces_named({"matchLabels": {"team": "x"}}) is None
    assert namespaces_named({"matchLabels": {NS_NAME: "a"}}) == {"a"}
    assert namespaces_named(_ns("a", "b")["namespaceSelector"]) == {"a", "b"}
    both = {"matchLabels": {NS_NAME: "a"}, **_ns("a", "b")["namespaceSelector"]}
    assert namespaces_named(both) == {"a"}
    assert peer_scope({"podSelector": {}}, "tandem") == "namespace"
    assert peer_scope(MONITORING, "tandem") == "monitoring"
    assert peer_scope(ANY_NAMESPACE, "tandem") == "outside"
