"""tandem plan's inputs and CLI: profiles, acceptance from recorded rounds, the roofline,
plan.json and the errors of bad flags (tools/plan)."""
from __future__ import annotations

import json

import pytest

from tools.plan.acceptance import from_rounds
from tools.plan.cli import main
from tools.plan.profile import Profile, interpolate, load_profile, save_profile
from tools.plan.roofline import roofline_profile

pytestmark = pytest.mark.unit


def test_acceptance_is_a_survival_estimate_by_position():
    # 4 rounds of k=2: accepted 2, 2, 1, 0 -> position 1: 3 of 4; position 2: 2 of 3
    acc = from_rounds([(2, 2), (2, 2), (2, 1), (2, 0), (0, 0), (0, 0), (0, 0), (0, 0)])
    assert acc.position_rates == pytest.approx((0.75, 2 / 3))
    assert acc.propose_rate == pytest.approx(0.5)  # half the rounds had drafts
    assert acc.histogram["2"] == {"2": 2, "1": 1, "0": 1}
    assert acc.mean_length(2) == pytest.approx(1 + 0.75 + 0.5)
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        from_rounds([(2, 3)])


def test_profile_round_trips_and_rejects_nonsense(tmp_path):
    p = Profile("x", "test", {1: 5.0, 8: 6.0}, kv_tokens=100)
    save_profile(p, tmp_path / "p.json")
    assert load_profile(str(tmp_path / "p.json")) == p
    assert interpolate(p.verify_ms, 4.5) == pytest.approx(5.5)
    assert interpolate(p.verify_ms, 15) == pytest.approx(7.0)  # the last slope goes on
    with pytest.raises(ValueError, match="sizes >= 1"):
        Profile("x", "t", {0: 1.0})
    with pytest.raises(ValueError, match="built-ins are"):
        load_profile("no-such-profile")


def test_roofline_is_weight_bound_at_decode_and_compute_bound_at_prefill():
    p = roofline_profile("h100", "llama-3.1-8b", "l4", "llama-3.2-1b")
    # 7.5 G weights read (layers + lm_head) x 2 bytes over 3.35 TB/s x 0.7: ~6.4 ms, flat
    assert p.verify_ms[1] == pytest.approx(6.4, rel=0.05)
    assert p.verify_ms[16] == p.verify_ms[1]
    assert p.verify_ms[4096] > 10 * p.verify_ms[1]
    assert "roofline" in p.source and "L4" in p.source
    assert p.kv_tokens > 100_000  # 80 GB less the weights, at 128 KiB per token
    eagle = roofline_profile("h100", "llama-3.1-8b", "", "eagle3-llama-3.1-8b", colocated=True)
    assert eagle.colocated_draft and eagle.draft_ms[1] < p.draft_ms[1]
    with pytest.raises(ValueError, match="unknown GPU"):
        roofline_profile("tpu", "llama-3.1-8b")


def test_simulate_writes_plan_json(tmp_path, capsys):
    prof = tmp_path / "p.json"
    save_profile(Profile("t", "test", {1: 5.0, 64: 20.0}), prof)
    rc = main(["plan", "simulate", "--verifiers", "1", "--drafts", "1", "--method",
               "draft_model", "--num-speculative-tokens", "4", "--concurrency", "2",
               "--prompt-tokens", "16", "--max-tokens", "8", "--requests", "4", "--profile",
               str(prof), "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 0
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    for key in ("throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                "tpot_ms_p99", "acceptance_length_mean"):
        assert plan[key] > 0
    assert plan["profile"]["name"] == "t" and plan["label"] == "simulation"
    assert plan["output_tokens"] == 4 * 8


@pytest.mark.parametrize("argv, msg", [
    (["--concurrency", "2", "--rate", "1"], "exactly one of"),
    (["--concurrency", "0"], "exactly one of"),
    (["--concurrency", "2", "--verifiers", "0"], "--verifiers must be >= 1"),
    (["--concurrency", "2", "--profile", "nope"], "no profile 'nope'"),
])
def test_bad_flags_exit_2_with_the_reason(argv, msg, capsys):
    assert main(["plan", "simulate", "--no-progress", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_unknown_method_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "simulate", "--method", "magic", "--concurrency", "1"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_validation_overheads_and_prefill_line():
    from tools.plan.report import _with_prefills
    from tools.plan.validate import overheads

    rounds = [{"verify_ms": 40.0, "rejection_ms": 2.0}] + [
        {"verify_ms": 20.0, "rejection_ms": 2.0}] * 7
    run = {"start": 0.0, "first": 0.1, "last": 0.1 + 7 * 0.030, "tokens": 8, "rounds": rounds}
    got = overheads([run, run])
    assert got["gateway_ms"] == pytest.approx(100 - 42)  # TTFT beyond the first round
    assert got["step_gap_ms"] == pytest.approx(30 - 22)  # a token beyond its round
    curve = _with_prefills({1: 10.0, 17: 20.0, 64: 999.0},
                           [{"prompt_tokens": q, "verify_ms": 5 + q} for q in (40, 80, 120)])
    assert curve[1] == 10.0 and curve[17] == 20.0  # the small sizes keep the calibrated shape
    assert curve[40] == 45.0 and curve[120] == 125.0 and 64 not in curve  # the prefills'
    assert curve[2048] == pytest.approx(125.0 + 1928.0)  # then their fitted slope
    slow = _with_prefills({1: 10.0}, [{"prompt_tokens": q, "verify_ms": ms}
                                      for q, ms in ((40, 50.0), (60, 30.0), (80, 90.0))])
    assert slow[60] == 50.0  # never cheaper for more tokens
