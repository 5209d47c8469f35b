"""vLLM's spec-decode metrics on a verifier's /metrics (tandem.telemetry.VllmSpecDecodeMetrics):
after real verification rounds through the engine (n-gram drafts on a tiny target), the
scraped series carry vLLM's names and labels, agree with each other as vLLM's do (accepted <=
draft tokens, the positions sum to accepted and fall with the position) and with Tandem's own
counters and the sessions' totals; the PromQL of vLLM-style dashboard panels and of the
shipped dashboard names only series that are there."""
import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.llama import LlamaModel
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.telemetry import VerifierMetrics, start_metrics_server

pytestmark = pytest.mark.integration
K = 4
# Panels as vLLM's Grafana dashboards and docs write them (rates by model_name, positions).
VLLM_PANELS = (
    'rate(vllm:spec_decode_num_accepted_tokens_total{model_name="$model_name"}[$__rate_interval])'
    ' / rate(vllm:spec_decode_num_draft_tokens_total{model_name="$model_name"}'
    '[$__rate_interval])',
    '1 + rate(vllm:spec_decode_num_accepted_tokens_total[$__rate_interval]) / '
    'rate(vllm:spec_decode_num_drafts_total[$__rate_interval])',
    'sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total'
    '{model_name="$model_name", engine="0"}[$__rate_interval]))',
)
_NAME = re.compile(r"\bvllm:[a-z0-9_:]+")
_SELECTED = re.compile(r"(\w+)=~?\"")


def _scrape(metrics: VerifierMetrics) -> dict[str, list]:
    port = start_metrics_server(0, metrics.registry, host="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.fixture(scope="module")
def rounds(tmp_path_factory, monkeypatch_module):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import eagle3_tiny
    import inproc

    metrics = VerifierMetrics(model_name="tiny", num_positions=K)

    class Measured(inproc.Engine):
        def __init__(self, *args, **kw):
            super().__init__(*args, **{**kw, "metrics": metrics})

    monkeypatch_module.setattr(inproc, "Engine", Measured)
    model = LlamaModel.load(eagle3_tiny.tiny_target(tmp_path_factory.mktemp("t") / "target"))
    gen = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(0, 20, (6,), generator=gen).tolist() * 3) for _ in range(3)]
    _, drafted, accepted, _ = inproc.run_sessions(
        model, {Method.NGRAM: NgramProposer(3, K)}, Method.NGRAM, prompts,
        SamplingParams(temperature=0.0), 24, max_spec_tokens=K)
    return _scrape(metrics), drafted, accepted


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _value(samples, name, **labels):
    return sum(s.value for s in samples.get(name, ())
               if all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_series_are_consistent_after_rounds(rounds):
    samples, drafted, accepted = rounds
    v = "vllm:spec_decode_"
    drafts = _value(samples, v + "num_drafts_total", model_name="tiny", engine="0")
    tokens = _value(samples, v + "num_draft_tokens_total", model_name="tiny", engine="0")
    acc = _value(samples, v + "num_accepted_tokens_total", model_name="tiny", engine="0")
    per_pos = [_value(samples, v + "num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(K)]
    assert drafts > 0 and acc > 0, "the rounds drafted and accepted something"
    assert acc <= tokens <= K * drafts
    assert sum(per_pos) == acc and per_pos[0] <= drafts
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert {s.labels["position"] for s in samples[v + "num_accepted_tokens_per_pos_total"]} \
        == {str(i) for i in range(K)}  # every position exists, as in vLLM
    # the same figures as Tandem's own counters and the sessions' totals
    assert (tokens, acc) == (drafted, accepted)
    assert drafts == _value(samples, "tandem_spec_num_drafts_total")
    assert acc == _value(samples, "tandem_spec_num_accepted_tokens_total")


def test_vllm_panels_read_series_that_are_there(rounds):
    samples, _, _ = rounds
    for expr in VLLM_PANELS:
        for name in _NAME.findall(expr):
            assert name in samples, name
            labels = set(samples[name][0].labels)
            selector = re.search(re.escape(name) + r"(?:\{([^}]*)\})?", expr).group(1) or ""
            assert set(_SELECTED.findall(selector)) <= labels, (name, selector)
    dashboard = json.loads((Path(__file__).resolve().parents[2]
                            / "deploy/monitoring/grafana-dashboard.json").read_text())
    shipped = {n for panel in dashboard["panels"] for t in panel.get("targets", ())
               for n in _NAME.findall(t["expr"])}
    assert {"vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total"} <= shipped
    assert shipped <= set(samples)
