"""tandem plan simulate: the simulation behaves as a deployment would (tools/plan/sim.py)."""
from __future__ import annotations

import json

import pytest

from tools.plan.acceptance import MethodAcceptance
from tools.plan.config import SimConfig
from tools.plan.profile import Profile
from tools.plan.sim import simulate

pytestmark = pytest.mark.unit

# A forward that costs the same for 1..8 tokens (memory-bound), then grows linearly.
FLAT = Profile("flat", "test", {1: 10.0, 8: 10.0, 64: 40.0, 512: 300.0},
               draft_ms={1: 1.0, 32: 2.0}, step_overhead_ms=0.0, seq_overhead_ms=0.0,
               net_latency_ms=0.1, gateway_ms=0.0)


def run(**kw):
    acc = kw.pop("acc", None)
    profile = kw.pop("profile", FLAT)
    base = dict(prompt_tokens=32, max_tokens=41, requests=16)
    return simulate(SimConfig(**{**base, **kw}), profile, acc)


def test_throughput_rises_with_concurrency_until_saturation():
    t = {c: run(concurrency=c, max_num_seqs=8)["throughput_tok_s"] for c in (1, 4, 8, 16)}
    assert t[1] < t[4] < t[8]
    assert t[4] > 3 * t[1]  # a memory-bound step serves 4 sessions for the price of one
    assert t[16] == pytest.approx(t[8], rel=0.15)  # 8 running at most: saturated


def test_perfect_acceptance_speeds_up_by_tokens_per_round():
    plain = run(concurrency=1, requests=4)
    spec = run(concurrency=1, requests=4, method="ngram", num_speculative_tokens=4,
               acc=MethodAcceptance((1.0,), propose_rate=1.0))
    assert plain["acceptance_length_mean"] == pytest.approx(1.0)
    # 1 prefill token + 8 rounds x 5 tokens: 41 tokens over 9 rounds
    assert spec["acceptance_length_mean"] == pytest.approx(41 / 9, rel=0.02)
    assert plain["tpot_ms_p50"] / spec["tpot_ms_p50"] == pytest.approx(5.0, rel=0.1)


def test_zero_acceptance_falls_back_to_plain_decoding():
    spec = run(concurrency=1, requests=4, method="ngram",
               acc=MethodAcceptance((0.0,), propose_rate=1.0))
    plain = run(concurrency=1, requests=4)
    assert spec["acceptance_length_mean"] == pytest.approx(1.0)
    # the cost model switches speculation off (probe rounds aside): at most ~10% slower
    assert spec["throughput_tok_s"] > 0.85 * plain["throughput_tok_s"]


def test_small_kv_cache_preempts_and_still_finishes():
    small = Profile("small", "test", FLAT.verify_ms, kv_tokens=320, block_size=16,
                    step_overhead_ms=0.0, seq_overhead_ms=0.0, gateway_ms=0.0)
    r = run(profile=small, concurrency=8, prompt_tokens=64, max_tokens=64)
    assert r["preemptions"] > 0
    assert r["output_tokens"] == 16 * 64
    roomy = run(concurrency=8, prompt_tokens=64, max_tokens=64)
    assert roomy["preemptions"] == 0
    assert roomy["throughput_tok_s"] > r["throughput_tok_s"]


def test_poisson_overload_grows_ttft():
    light = run(rate=1.0, requests=20)
    heavy = run(rate=500.0, requests=20, max_num_seqs=2)
    assert heavy["ttft_ms_p99"] > 5 * light["ttft_ms_p99"]


def test_draft_pool_drafts_and_more_verifiers_add_throughput():
    acc = MethodAcceptance((0.9,))
    one = run(concurrency=1, requests=4, method="draft_model", acc=acc)
    assert one["accepted_tokens"] > 0
    assert one["acceptance_length_mean"] > 2.0
    t1 = run(concurrency=16, max_num_seqs=4)["throughput_tok_s"]
    t2 = run(concurrency=16, max_num_seqs=4, verifiers=2)["throughput_tok_s"]
    assert t2 > 1.6 * t1


@pytest.mark.parametrize("kw, msg", [
    (dict(concurrency=1, rate=1.0), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(concurrency=1, method="bogus"), "--method"),
    (dict(concurrency=1, verifiers=0), "--verifiers"),
    (dict(concurrency=1, method="draft_model", drafts=0), "--drafts"),
])
def test_bad_configs_say_why(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SimConfig(**kw)


def test_trace_replays_arrivals_and_lengths(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"t": i * 0.5, "prompt_tokens": 16 + i,
                                           "max_tokens": 5 + i, "conversation": f"c{i % 2}"})
                               for i in range(6)) + "\n")
    r = run(trace=str(trace), verifiers=2)
    assert r["requests"] == 6
    assert r["output_tokens"] == sum(5 + i for i in range(6))
    with pytest.raises(ValueError, match="needs t, prompt_tokens"):
        (tmp_path / "bad.jsonl").write_text('{"t": 1}\n')
        run(trace=str(tmp_path / "bad.jsonl"))


def test_shared_prefix_hits_the_real_prefix_cache():
    cold = run(concurrency=1, requests=8, prompt_tokens=512)
    shared = run(concurrency=1, requests=8, prompt_tokens=512, shared_prefix_tokens=480)
    assert shared["ttft_ms_p50"] < 0.5 * cold["ttft_ms_p50"]
