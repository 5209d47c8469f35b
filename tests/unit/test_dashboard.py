"""The Grafana dashboard (deploy/monitoring/grafana-dashboard.json) reads only series the three
services really export: every metric name in a panel's PromQL is a sample name that the
metrics classes render, and every label it groups or selects by exists on it (or is one that
Prometheus adds at scrape time)."""
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.telemetry import DraftMetrics, GatewayMetrics, VerifierMetrics, render

pytestmark = pytest.mark.unit
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/monitoring/grafana-dashboard.json"
SCRAPE_LABELS = {"le", "pod", "namespace", "instance", "job", "container"}
_METRIC = re.compile(r"\b(?:tandem_|vllm:)[a-z0-9_:]+")  # ours, and vLLM's spec-decode names
_GROUPING = re.compile(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, from every service's registry with one of everything."""
    verifier = VerifierMetrics()
    verifier.bind_load(lambda: 1, lambda: 0, lambda: 0.5)
    verifier.observe_round(3, 2, 1.0, 2.0, 0.5)
    verifier.ttft.observe(0.1)
    gateway = GatewayMetrics()
    gateway.requests.labels(endpoint="chat", status="200").inc()
    for h in (gateway.ttft, gateway.itl, gateway.e2e):
        h.observe(0.1)
    draft = DraftMetrics(lambda: 1, lambda: 0, lambda: 5)
    out: dict[str, set[str]] = {}
    for registry in (verifier.registry, gateway.registry, draft.registry):
        for family in text_string_to_metric_families(render(registry).decode()):
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


def problems(dashboard: dict, samples: dict[str, set[str]]) -> list[str]:
    found = []
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    if not panels:
        found.append("no panels")
    for panel in panels:
        if not panel.get("targets"):
            found.append(f"{panel['title']}: no queries")
        for target in panel.get("targets", []):
            expr = target["expr"]
            names = _METRIC.findall(expr)
            if not names:
                found.append(f"{panel['title']}: no exported metric in {expr!r}")
            unknown = [n for n in names if n not in samples]
            found += [f"{panel['title']}: {n} is not exported" for n in unknown]
            labels = set().union(*(samples.get(n, set()) for n in names)) | SCRAPE_LABELS
            used = {x.strip() for g in _GROUPING.findall(expr) for x in g.split(",") if x.strip()}
            used |= set(_LEGEND.findall(target.get("legendFormat", "")))
            found += [f"{panel['title']}: label {x!r} is not on {names}" for x in used - labels]
    return found


def test_every_panel_reads_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    assert problems(dashboard, exported()) == []
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("acceptance by draft position", "tokens committed per round", "round phases",
                  "mean acceptance length",
                  "time to first token", "inter-token", "kv cache", "queue depth"):
        assert topic in titles, topic


def test_the_check_catches_a_wrong_metric_or_label():
    samples = exported()
    bad = {"panels": [{"title": "x", "targets": [
        {"expr": "rate(tandem_spec_num_drafts[5m])", "legendFormat": ""},  # missing _total
        {"expr": "sum by (phaze) (rate(tandem_round_phase_seconds_count[5m]))",
         "legendFormat": "{{phaze}}"}]}]}
    found = problems(bad, samples)
    assert any("tandem_spec_num_drafts is not exported" in f for f in found)
    assert any("'phaze'" in f for f in found)
