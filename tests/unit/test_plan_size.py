"""tandem plan size's answers: where speculation stops paying, and the HPA patch in the metrics
deploy/k8s/base/hpa.yaml scales on (tools/plan/size.py, size_report.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tools.plan.size import off_above
from tools.plan.size_report import hpa_patch

pytestmark = pytest.mark.unit

ARGS = SimpleNamespace(method="draft_model", overlay="prod-gpu", traffic_rate=10.0,
                       prompt_tokens=512, max_tokens=256, slo_ttft_ms=1000.0, slo_tpot_ms=50.0)


def _pick(v, d, usd, waiting=0.4, kv=0.3, batch=3.0):
    return {"verifiers": v, "drafts": d, "usd_per_mtok": usd, "cost_hr": 1.0,
            "result": {"waiting_sessions_mean": waiting, "kv_cache_usage_mean": kv,
                       "draft_batch_mean": batch}}


def test_speculation_off_above_the_first_load_where_it_stops_paying():
    rows = [{"concurrency": c, "throughput_none": n, "throughput_spec": s}
            for c, n, s in ((1, 100, 180), (4, 350, 500), (16, 1200, 1190), (64, 3000, 2900))]
    assert off_above(rows) == 16
    assert off_above(rows[:2]) is None


def test_patch_names_the_hpa_metrics_and_sizes_both_pools():
    result = {"profile": {"name": "roofline-x"}, "none": _pick(3, 0, 0.5),
              "draft_model": _pick(2, 4, 0.3, kv=0.6)}
    doc = hpa_patch(ARGS, result)
    for metric in ("tandem_verifier_waiting_sessions", "tandem_verifier_kv_cache_usage_ratio",
                   "tandem_draft_queue_depth"):
        assert metric in doc
    assert "minReplicas: 2   # sized: 2" in doc and "minReplicas: 4" in doc
    assert "maxReplicas: 8" in doc
    assert "averageValue: 750m" in doc  # 0.6 KV usage x 1.25 headroom
    assert "SIMULATION" in doc


def test_patch_drops_the_draft_pool_when_plain_decoding_is_cheaper():
    result = {"profile": {"name": "roofline-x"}, "none": _pick(2, 0, 0.3),
              "draft_model": _pick(2, 2, 0.4)}
    doc = hpa_patch(ARGS, result)
    assert "tandem_draft_queue_depth" not in doc
    assert "scale tandem-draft to 0" in doc
