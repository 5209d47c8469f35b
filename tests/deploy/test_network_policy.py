"""No internal port is reachable from outside the namespace, and no pod dials more than it
needs, in every rendered overlay.

Ingress. test_manifests.py evaluates the policies against a few stand-in pods; this reads the
rendered NetworkPolicies themselves, so a rule admitting a namespace or address no stand-in lives
in is caught too. For every pod of the render (verifier, draft, gateway, Redis, the collector):

- some NetworkPolicy in its namespace with policyTypes Ingress selects it (else it is open);
- every ingress rule of those policies admits only pods of the same namespace: a podSelector
  without a namespaceSelector, or a namespaceSelector that matches only that namespace by name.
  Two exceptions: the gateway's public port may admit anyone, and a metrics port
  (--metrics-port, every role) may admit the monitoring namespace, where Prometheus runs.

Egress. Every pod is isolated for egress (default deny), and the policies are evaluated flow by
flow (NetworkPolicy semantics: the source's egress AND the destination's ingress must allow):
the flows Tandem needs are allowed (DNS, gateway -> verifier, verifier -> draft, every role ->
Redis and the collector); the ones it does not are refused by the source's egress policy on its
own (draft -> verifier, gateway -> draft, Redis -> anything, anything -> the internet).

Negative tests mutate the rendered policies and require the checks to catch each one.
"""
from __future__ import annotations

import copy
import ipaddress
from dataclasses import dataclass, field

import pytest
from test_manifests import (
    ROLES,
    TARGETS,
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
    role_deployments,
    selector_matches,
    tandem_containers,
    workloads,
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
        if flags.get("metrics-port"):
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
    deployments = workloads(docs)
    components = {pod_labels(d).get("app.kubernetes.io/component") for d in deployments}
    problems += [f"no {role} Deployment in the render" for role in ROLES
                 if role not in components]
    for dep in deployments:
        problems += pod_exposure(docs, dep)
    return problems


# ------------------------------------------------------------------------------------ egress

EXTERNAL_IP = "203.0.113.7"  # TEST-NET-3: an address outside the cluster (a managed service)
REDIS_PORT = 6379
OTLP_PORTS = (4317, 4318)
DNS_PORT = 53


@dataclass(eq=False)
class Endpoint:
    """One end of a flow: the pods of a workload, a stand-in pod elsewhere in the cluster, or an
    address outside it (namespace None)."""
    who: str
    namespace: str | None
    labels: dict[str, str] = field(default_factory=dict)
    containers: list[Doc] = field(default_factory=list)
    ip: str | None = None


def endpoints(docs: list[Doc]) -> dict[str, Endpoint]:
    """The render's pods by role (or workload name), plus kube-dns, Prometheus and the internet."""
    out = {}
    for w in workloads(docs):
        labels = pod_labels(w)
        who = labels.get("app.kubernetes.io/component") \
            if labels.get("app.kubernetes.io/name") == "tandem" else w["metadata"]["name"]
        out[who] = Endpoint(who, namespace_of(w), labels, pod_spec(w)["containers"])
    out["kube-dns"] = Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
    out["prometheus"] = Endpoint("prometheus", "monitoring", dict(PROMETHEUS))
    out["internet"] = Endpoint("internet", None, ip=EXTERNAL_IP)
    return out


def policy_types(policy: Doc) -> list[str]:
    """policyTypes, with the API's default: Ingress, plus Egress when it has egress rules."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _peer_admits(peer: Doc, policy_ns: str, other: Endpoint, may: bool) -> bool:
    """Whether a `from`/`to` peer covers `other`. An ipBlock covering pod IPs depends on the CNI:
    `may` (what could pass) counts it, must-pass does not."""
    if "ipBlock" in peer:
        if other.namespace is not None:
            return may
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        net = ipaddress.ip_network(block["cidr"], strict=False)
        excepted = [ipaddress.ip_network(e, strict=False) for e in block.get("except") or []]
        return ip.version == net.version and ip in net and \
            not any(ip.version == e.version and ip in e for e in excepted)
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], {NS_NAME: other.namespace}):
            return False
    elif other.namespace != policy_ns:
        return False
    return selector_matches(peer.get("podSelector"), other.labels)


def _ports_admit(rule_ports: list[Doc] | None, port: int, protocol: str, dst: Endpoint) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        if rp.get("protocol", "TCP") != protocol:
            continue
        if "port" not in rp:
            return True
        value = rp["port"]
        if isinstance(value, str) and not value.isdigit():  # named: the destination's port
            start = next((p for c in dst.containers
                          if (p := resolve_port(value, c)) is not None), None)
        else:
            start = int(value)
        if start is not None and start <= port <= rp.get("endPort", start):
            return True
    return False


def direction_allows(docs: list[Doc], direction: str, subject: Endpoint, other: Endpoint,
                     port: int, protocol: str = "TCP", *, may: bool = False) -> bool:
    """Whether `subject`'s policies of this direction ('Ingress': other -> subject, 'Egress':
    subject -> other) let the connection through. Not a pod, or not isolated: yes."""
    if subject.namespace is None:
        return True
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    dst = subject if direction == "Ingress" else other
    selecting = [p for p in of_kind(docs, "NetworkPolicy")
                 if namespace_of(p) == subject.namespace and direction in policy_types(p)
                 and selector_matches(p["spec"].get("podSelector"), subject.labels)]
    if not selecting:
        return True
    return any((not rule.get(peers_key)
                or any(_peer_admits(peer, subject.namespace, other, may)
                       for peer in rule[peers_key]))
               and _ports_admit(rule.get("ports"), port, protocol, dst)
               for pol in selecting for rule in pol["spec"].get(rules_key) or [])


def flow_allowed(docs: list[Doc], src: Endpoint, dst: Endpoint, port: int,
                 protocol: str = "TCP") -> bool:
    """A connection passes when the source's egress AND the destination's ingress allow it."""
    return direction_allows(docs, "Egress", src, dst, port, protocol) and \
        direction_allows(docs, "Ingress", dst, src, port, protocol)


def check_egress(docs: list[Doc]) -> list[str]:
    """Every pod isolated for egress; the flows Tandem needs pass both ends' policies; the
    flows it must not make are refused by the source's egress policies on their own."""
    problems = []
    eps = endpoints(docs)
    pods = [eps[w] for w in eps if eps[w].containers]
    for ep in pods:
        if not any(namespace_of(p) == ep.namespace and "Egress" in policy_types(p)
                   and selector_matches(p["spec"].get("podSelector"), ep.labels)
                   for p in of_kind(docs, "NetworkPolicy")):
            problems.append(f"{ep.who} pods are selected by no egress NetworkPolicy (may dial "
                            "anything)")
    ports = {role: int(parse_flags(c["args"][1:])["port"])
             for _d, c, role in tandem_containers(docs)}
    missing = set(ROLES) - set(role_deployments(docs))
    if missing:
        return problems + [f"no {sorted(missing)} in the render"]
    redis = "redis" if "redis" in eps else "internet"  # no in-cluster Redis: a managed one
    needed = [(ep.who, "kube-dns", DNS_PORT, proto) for ep in pods if ep.who != "redis"
              for proto in ("UDP", "TCP")]
    needed += [("gateway", "verifier", ports["verifier"], "TCP"),
               ("verifier", "draft", ports["draft"], "TCP")]
    needed += [(role, redis, REDIS_PORT, "TCP") for role in ROLES]
    if "otel-collector" in eps:
        needed += [(role, "otel-collector", p, "TCP") for role in ROLES for p in OTLP_PORTS]
    for src, dst, port, proto in needed:
        if not flow_allowed(docs, eps[src], eps[dst], port, proto):
            problems.append(f"{src} -> {dst}:{port}/{proto} is refused (egress of {src} or "
                            f"ingress of {dst}); Tandem needs it")
    refused = [("draft", "verifier", ports["verifier"], "TCP"),
               ("gateway", "draft", ports["draft"], "TCP"),
               ("verifier", "gateway", ports["gateway"], "TCP"),
               ("draft", "gateway", ports["gateway"], "TCP"),
               *[(role, "internet", 443, "TCP") for role in ROLES]]  # no model store by default
    if "redis" in eps:
        refused += [("redis", "kube-dns", DNS_PORT, "UDP"), ("redis", "internet", 443, "TCP"),
                    ("redis", "verifier", ports["verifier"], "TCP"),
                    *[(role, "internet", REDIS_PORT, "TCP") for role in ROLES]]
    for src, dst, port, proto in refused:
        if direction_allows(docs, "Egress", eps[src], eps[dst], port, proto, may=True):
            problems.append(f"{src} may dial {dst}:{port}/{proto}; its egress must refuse it")
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


# ------------------------------------------------------------------------------- egress tests

@pytest.mark.parametrize("target", TARGETS)
def test_egress_allows_only_the_flows_tandem_needs(target):
    problems = check_egress(render(target))
    assert not problems, "\n".join(problems)


def _set_egress(name: str, index: int, rule: Doc):
    def mutate(docs):
        _policy(docs, name)["spec"]["egress"][index] = rule
    return mutate


def _add_egress(name: str, rule: Doc):
    return lambda docs: _policy(docs, name)["spec"]["egress"].append(rule)


def _ingress_only(docs):
    for pol in of_kind(docs, "NetworkPolicy"):
        pol["spec"]["policyTypes"] = ["Ingress"]
        pol["spec"].pop("egress", None)


def _pods(component: str) -> Doc:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tandem",
                                            "app.kubernetes.io/component": component}}}


EGRESS_BROKEN = {
    "draft-may-dial-anything": _add_egress("tandem-draft", {}),
    "gateway-dials-drafts-not-verifiers": _set_egress(
        "tandem-gateway", 0, {"to": [_pods("draft")], "ports": [{"port": 50052}]}),
    "verifier-refuses-the-gateway": _set_peer("tandem-verifier", 0, _pods("draft")),
    "no-dns": _drop("allow-dns-egress"),
    "dns-over-tcp-only": lambda docs: _policy(docs, "allow-dns-egress")["spec"][
        "egress"][0].update(ports=[{"protocol": "TCP", "port": 53}]),
    "redis-resolves-names": lambda docs: _policy(docs, "allow-dns-egress")["spec"].update(
        podSelector={}),
    "gateway-to-the-internet": _add_egress("tandem-gateway", {"to": [
        {"ipBlock": {"cidr": "0.0.0.0/0"}}]}),
    "no-egress-isolation": _ingress_only,
    "draft-loses-the-collector": _set_egress("tandem-draft", 1, {"to": [_pods("redis")], "ports": [
        {"port": 6379}]}),
}


@pytest.mark.parametrize("case", list(EGRESS_BROKEN))
def test_an_egress_mistake_is_caught(case):
    docs = render("dev")
    assert not check_egress(docs)
    EGRESS_BROKEN[case](docs)
    assert check_egress(docs), f"missed: {case}"


def test_flow_evaluation():
    """Both ends must allow; protocols and ports are told apart; an ipBlock counts for pods only
    as 'may'; an address outside the cluster matches an ipBlock by CIDR (and except)."""
    docs = render("dev")
    eps = endpoints(docs)
    gateway, verifier, draft = eps["gateway"], eps["verifier"], eps["draft"]
    assert flow_allowed(docs, gateway, verifier, 50051)
    assert not flow_allowed(docs, gateway, verifier, 50052)
    assert not flow_allowed(docs, draft, verifier, 50051)
    assert flow_allowed(docs, draft, eps["kube-dns"], 53, "UDP")
    assert not flow_allowed(docs, draft, eps["kube-dns"], 54, "UDP")
    # an open egress alone does not make a flow: the verifier's ingress still refuses drafts
    _add_egress("tandem-draft", {})(docs)
    assert direction_allows(docs, "Egress", draft, verifier, 50051)
    assert not flow_allowed(docs, draft, verifier, 50051)
    world = {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["203.0.113.0/24"]}}
    assert not _peer_admits(world, "tandem", eps["internet"], may=False)
    assert _peer_admits({"ipBlock": {"cidr": "203.0.113.0/24"}}, "tandem", eps["internet"], False)
    assert not _peer_admits({"ipBlock": {"cidr": "::/0"}}, "tandem", eps["internet"], False)
    assert _peer_admits(world, "tandem", verifier, may=True)
    assert not _peer_admits(world, "tandem", verifier, may=False)
    assert policy_types({"spec": {"egress": []}}) == ["Ingress", "Egress"]
    assert policy_types({"spec": {}}) == ["Ingress"]


def test_the_external_redis_is_reached_on_its_port_only():
    docs = render("prod-gpu+external-redis")
    eps = endpoints(docs)
    assert "redis" not in eps
    for role in ("gateway", "verifier", "draft"):
        assert flow_allowed(docs, eps[role], eps["internet"], 6379)
        assert not direction_allows(docs, "Egress", eps[role], eps["internet"], 443, may=True)
