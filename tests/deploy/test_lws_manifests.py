"""Deploy tier: tensor-parallel verifiers (docs/design/tensor_parallel.md, issue 31).

overlays/prod-gpu-tp runs the verifier Deployment over N GPUs of one pod;
overlays/prod-gpu-multinode runs each verifier as a LeaderWorkerSet group: the leader (worker
index 0) is `tandem verifier` (rank 0, gRPC, Redis, metrics), the workers `tandem tp-worker`.
test_manifests.py's checks see the set's two pod templates as workloads (lws_views) and run on
every render, these overlays included; this module adds what only a tensor-parallel verifier
needs:

- the group's shape: startupPolicy LeaderReady, restartPolicy RecreateGroupOnPodRestart,
  tensor-parallel size = size x local ranks = the GPUs asked for, workers taking their ranks from
  LWS_WORKER_INDEX and dialling $(LWS_LEADER_ADDRESS) on the leader's rendezvous port;
- workers probed on the file `tandem tp-worker --ready-file` writes, kept up while their leader
  drains, on the leader's node class;
- metrics and Services on leaders only, the set's controller-made headless Service not shadowed;
- NetworkPolicies: rank-to-rank traffic (the rendezvous, the ephemeral range the pods' sysctl
  sets) between the set's pods only, both ends; the gateway reaches the leader's gRPC and nothing
  of the workers;
- broken overlays that these checks (or test_manifests.py's) must catch.
"""
from __future__ import annotations

import re

import pytest
from test_manifests import (
    GPU,
    LWS_API,
    LWS_LABEL,
    OVERLAYS,
    REGISTRY_LEAVE_S,
    TARGETS,
    Doc,
    find,
    name_of,
    node_requirements,
    of_kind,
    parse_flags,
    pod_labels,
    pod_spec,
    prestop_sleep_s,
    render,
    selector_matches,
    services_selecting,
    tandem_containers,
    workloads,
)
from test_network_policy import direction_allows, endpoints, flow_allowed

pytestmark = pytest.mark.deploy

MULTINODE = "prod-gpu-multinode"
ONE_POD_TP = "prod-gpu-tp"
PORT_RANGE_SYSCTL = "net.ipv4.ip_local_port_range"


def lws_parts(docs: list[Doc]) -> list[tuple[Doc, dict[str, tuple[Doc, Doc]]]]:
    """(set, {"leader"|"worker": (view, its first container)}) per LeaderWorkerSet."""
    out = []
    for lws in of_kind(docs, "LeaderWorkerSet"):
        views = [w for w in workloads(docs) if w.get("lws") is not None
                 and w["metadata"]["name"] == lws["metadata"]["name"]]
        out.append((lws, {v["lwsPart"]: (v, (pod_spec(v)["containers"] or [{}])[0])
                          for v in views}))
    return out


def gpus(container: Doc) -> int:
    return int(((container.get("resources") or {}).get("limits") or {}).get(GPU, 0))


def port_range(view: Doc) -> tuple[int, int] | None:
    sysctls = (pod_spec(view).get("securityContext") or {}).get("sysctls") or []
    value = next((s["value"] for s in sysctls if s["name"] == PORT_RANGE_SYSCTL), None)
    return tuple(map(int, value.split())) if value else None


def _int(flags: dict[str, str], key: str) -> int | None:
    return int(flags[key]) if flags.get(key, "").isdigit() else None


def rendezvous_port(leader_container: Doc) -> int | None:
    """The port of the leader's --tensor-parallel-master (rank 0's store listens on it)."""
    master = parse_flags(leader_container["args"][1:]).get("tensor-parallel-master", "")
    port = master.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def check_lws_shape(docs: list[Doc]) -> list[str]:
    """The group's policies, rank arithmetic, worker probes, drain and placement."""
    problems = []
    for lws, parts in lws_parts(docs):
        where = name_of(lws)
        spec, lwt = lws["spec"], lws["spec"]["leaderWorkerTemplate"]
        if spec.get("startupPolicy") != "LeaderReady":
            problems.append(f"{where}: startupPolicy must be LeaderReady (workers dial a leader "
                            "that listens)")
        if lwt.get("restartPolicy") != "RecreateGroupOnPodRestart":
            problems.append(f"{where}: restartPolicy must be RecreateGroupOnPodRestart (a lost "
                            "rank fails the whole group)")
        if "leaderTemplate" not in lwt:
            problems.append(f"{where}: no leaderTemplate (the leader runs `tandem verifier`)")
            continue
        (leader, lc), (worker, wc) = parts["leader"], parts["worker"]
        if (lc.get("args") or [None])[0] != "verifier" or \
                (wc.get("args") or [None])[0] != "tp-worker":
            problems.append(f"{where}: the leader runs `tandem verifier`, workers `tandem "
                            "tp-worker`")
            continue
        lf, wf = parse_flags(lc["args"][1:]), parse_flags(wc["args"][1:])
        size, local = _int(lf, "tensor-parallel-size"), _int(lf, "tensor-parallel-local-ranks")
        if size is None or local is None or size != lwt.get("size", 1) * local:
            problems.append(f"{where}: --tensor-parallel-size {size} != size "
                            f"{lwt.get('size', 1)} x --tensor-parallel-local-ranks {local}")
        if _int(wf, "tensor-parallel-size") != size:
            problems.append(f"{where}: the workers' --tensor-parallel-size "
                            f"{wf.get('tensor-parallel-size')} != the leader's {size}")
        if not (gpus(lc) == local == _int(wf, "local-ranks") == gpus(wc)):
            problems.append(f"{where}: one GPU per rank: leader {gpus(lc)} GPUs for {local} "
                            f"ranks, worker {gpus(wc)} for {wf.get('local-ranks')}")
        if wf.get("node-index") != "$(LWS_WORKER_INDEX)":
            problems.append(f"{where}: workers take their ranks from --node-index="
                            "$(LWS_WORKER_INDEX), not --first-rank")
        rendezvous = rendezvous_port(lc)
        if rendezvous not in {p["containerPort"] for p in lc.get("ports") or []}:
            problems.append(f"{where}: the rendezvous port {rendezvous} is no containerPort")
        if wf.get("master") != f"$(LWS_LEADER_ADDRESS):{rendezvous}":
            problems.append(f"{where}: workers must dial $(LWS_LEADER_ADDRESS):{rendezvous}, "
                            f"not {wf.get('master')!r}")
        if lf.get("tensor-parallel-timeout-s") != wf.get("tensor-parallel-timeout-s"):
            problems.append(f"{where}: leader and workers need the same collective timeout")
        ready = wf.get("ready-file", "")
        mounts = [m["mountPath"] for m in wc.get("volumeMounts") or []]
        if not ready or not any(ready.startswith(m.rstrip("/") + "/") for m in mounts):
            problems.append(f"{where}: workers need --ready-file on a writable mount "
                            f"(got {ready!r}, mounts {mounts})")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = ((wc.get(probe) or {}).get("exec") or {}).get("command")
            if command != ["test", "-f", ready]:
                problems.append(f"{where}: the workers' {probe} must be `test -f {ready}` "
                                f"(joined and loaded), not {command}")
        drain = float(lf.get("drain-grace-s", 5))
        need = prestop_sleep_s(lc) + REGISTRY_LEAVE_S + drain
        sleep = prestop_sleep_s(wc)
        if sleep < need:
            problems.append(f"{where}: workers' preStop sleeps {sleep:g} s; their ranks must "
                            f"outlive the leader's drain ({need:g} s)")
        if not pod_spec(worker).get("terminationGracePeriodSeconds", 30) > sleep:
            problems.append(f"{where}: the workers' grace must exceed their preStop sleep")
        lreq, wreq = node_requirements(pod_spec(leader)), node_requirements(pod_spec(worker))
        if lreq != wreq or pod_spec(leader).get("tolerations") != \
                pod_spec(worker).get("tolerations"):
            problems.append(f"{where}: workers must land on the leader's node class "
                            f"({lreq} vs {wreq})")
    return problems


def check_lws_routing(docs: list[Doc]) -> list[str]:
    """Services and PodMonitors see leaders only; the controller's Service is not shadowed."""
    problems = []
    for lws, parts in lws_parts(docs):
        name = lws["metadata"]["name"]
        if find(docs, "Service", name) is not None:
            problems.append(f"Service/{name}: the LeaderWorkerSet controller makes the headless "
                            "Service of the set's name (LWS_LEADER_ADDRESS); do not shadow it")
        leader, worker = parts["leader"][0], parts.get("worker", (None,))[0]
        if worker is None:
            continue
        for svc in services_selecting(docs, worker):
            problems.append(f"{name_of(svc)} selects {name}'s workers, which serve nothing")
        for mon in of_kind(docs, "PodMonitor"):
            if selector_matches(mon["spec"]["selector"], pod_labels(worker)):
                problems.append(f"{name_of(mon)} selects {name}'s workers: the leader reports "
                                "its group's metrics")
        if not any(selector_matches(m["spec"]["selector"], pod_labels(leader))
                   for m in of_kind(docs, "PodMonitor")) and of_kind(docs, "PodMonitor"):
            problems.append(f"no PodMonitor scrapes {name}'s leaders")
    return problems


def check_lws_network(docs: list[Doc]) -> list[str]:
    """Ranks reach each other on the rendezvous and the ephemeral range, both ways; nothing
    else reaches those ports; the gateway reaches no worker port at all."""
    problems = []
    eps = endpoints(docs)
    for lws, parts in lws_parts(docs):
        (leader, lc), (worker, _wc) = parts["leader"], parts["worker"]
        rng = port_range(leader)
        if rng is None or rng != port_range(worker):
            problems.append(f"{name_of(lws)}: both templates must set {PORT_RANGE_SYSCTL} "
                            "(the ephemeral ports NCCL and gloo listen on, which the policy "
                            "opens)")
            continue
        lf = parse_flags(lc["args"][1:])
        busy = {_int(lf, "port"), _int(lf, "metrics-port")}
        if any(p is not None and rng[0] <= p <= rng[1] for p in busy):
            problems.append(f"{name_of(lws)}: the ephemeral range {rng} covers the leader's "
                            f"ports {sorted(busy)}: opening it to ranks would open those")
        ends = {"leader": eps["verifier"], "worker": eps[pod_labels(worker)[
            "app.kubernetes.io/component"]]}
        rank_ports = [rendezvous_port(lc), *rng]
        for src, dst in (("worker", "leader"), ("leader", "worker"), ("worker", "worker")):
            for port in rank_ports:
                if not flow_allowed(docs, ends[src], ends[dst], port):
                    problems.append(f"{src} -> {dst}:{port} is refused: ranks need it")
        outsiders = [w for w in eps if w not in ("verifier", ends["worker"].who)
                     and eps[w].namespace is not None]
        # refused by the destination's ingress on its own, whatever the source's egress says
        for who in outsiders:
            for dst in ("leader", "worker"):
                for port in rank_ports:
                    if direction_allows(docs, "Ingress", ends[dst], eps[who], port, may=True):
                        problems.append(f"{who} -> {dst}:{port} is admitted: only ranks of "
                                        "the set may use the rank ports")
        for port in {_int(lf, "port"), _int(lf, "metrics-port"), *rank_ports}:
            if direction_allows(docs, "Ingress", ends["worker"], eps["gateway"], port,
                                may=True):
                problems.append(f"gateway -> worker:{port} is admitted; workers serve nothing")
    return problems


def check_tp_gpus(docs: list[Doc]) -> list[str]:
    """A one-pod tensor-parallel verifier asks for one GPU per rank."""
    problems = []
    for dep, c, role in tandem_containers(docs):
        if role != "verifier" or dep.get("lws") is not None:
            continue
        flags = parse_flags(c["args"][1:])
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        size = int(flags.get("tensor-parallel-size")
                   or env.get("TANDEM_VERIFIER_TENSOR_PARALLEL_SIZE") or 1)
        if GPU in str(c.get("resources")) and gpus(c) != size:
            problems.append(f"{name_of(dep)}: --tensor-parallel-size {size} on {gpus(c)} GPUs "
                            "(one per rank)")
    return problems


LWS_CHECKS = [check_lws_shape, check_lws_routing, check_lws_network, check_tp_gpus]


@pytest.mark.parametrize("check", LWS_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
@pytest.mark.parametrize("target", TARGETS)
def test_render_passes_the_tp_checks(target, check):
    problems = check(render(target))
    assert not problems, "\n".join(problems)


def test_the_tp_overlays_are_checked():
    assert {MULTINODE, ONE_POD_TP} <= set(OVERLAYS)  # so every test_manifests.py check runs


def test_multinode_runs_the_verifier_as_a_leaderworkerset_only():
    docs = render(MULTINODE)
    assert find(docs, "Deployment", "tandem-verifier") is None
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == LWS_API and "replicas" not in lws["spec"]
    roles = {role: dep for dep, _c, role in tandem_containers(docs)}
    assert roles["verifier"].get("lwsPart") == "leader"
    (hpa,) = [h for h in of_kind(docs, "HorizontalPodAutoscaler")
              if h["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
                                             "name": lws["metadata"]["name"]}
    mon = find(docs, "PodMonitor", "tandem-verifier")
    assert mon["spec"]["selector"]["matchLabels"][LWS_LABEL + "worker-index"] == "0"


def test_one_pod_tp_asks_for_its_gpus():
    docs = render(ONE_POD_TP)
    (dep,) = [d for d, _c, role in tandem_containers(docs) if role == "verifier"]
    c = pod_spec(dep)["containers"][0]
    assert int(parse_flags(c["args"][1:])["tensor-parallel-size"]) == gpus(c) > 1


def test_worker_args_give_the_ranks_with_the_real_cli(monkeypatch):
    """The worker's args, with what LWS injects substituted, are ranks 4-7 of 8 on the second
    pod of a group, dialling its leader."""
    from tools.cli import build_parser
    from verify_service.tp.cli import specs_from

    for key in ("TANDEM_MODEL", "TANDEM_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    ((_lws, parts),) = lws_parts(render(MULTINODE))
    values = {"LWS_WORKER_INDEX": "1",
              "LWS_LEADER_ADDRESS": "tandem-verifier-tp-0.tandem-verifier-tp.tandem"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a)
            for a in parts["worker"][1]["args"]]
    parsed = build_parser().parse_args([*args, "--device", "cpu"])
    specs = specs_from(parsed)
    assert [s.rank for s in specs] == [4, 5, 6, 7] and {s.world_size for s in specs} == {8}
    assert specs[0].init_method == f"tcp://{values['LWS_LEADER_ADDRESS']}:29500"
