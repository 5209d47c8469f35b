"""What `tandem plan validate` models from its own measurements (issue 50): the run profile's
curves (tools/plan/runprofile.py), the warm passes' overheads (validate.overheads), the
kept-alive connection's hold in the simulation, and acceptance without the prefill round."""
import pytest

from tools.plan.acceptance import decode_rounds
from tools.plan.config import SimConfig
from tools.plan.profile import Profile
from tools.plan.runprofile import batch_extra, closed_ratios, monotone
from tools.plan.session import SimSession
from tools.plan.sim import simulate
from tools.plan.validate import overheads


def test_monotone_pools_a_dip_with_its_neighbours():
    got = monotone({1: 15.0, 2: 21.0, 4: 30.0, 5: 26.0, 6: 28.0, 8: 29.0})
    assert got[1] == 15.0 and got[2] == 21.0
    assert got[4] == got[5] == got[6] == pytest.approx(28.0)  # (30 + 26 + 28) / 3
    assert got[8] == 29.0
    assert list(got.values()) == sorted(got.values())


def test_batch_extra_levels_the_calibrated_batch_curve_by_the_runs_steps():
    base = Profile("p", "test", verify_ms={1: 10.0, 2: 14.0, 4: 16.0, 16: 30.0},
                   batch_ms={1: 10.0, 2: 15.0, 4: 20.0, 16: 40.0})
    verify = {q: ms * 1.1 for q, ms in base.verify_ms.items()}  # levelled by c=1's steps
    ratio = closed_ratios(base, {"c=1": 11.0, "c=4": 24.0, "c=16": 60.0}, 1.1)
    extra = batch_extra(base, verify, ratio)
    assert extra[1] == pytest.approx(0.0)
    assert extra[4] == pytest.approx(24.0 - 16.0 * 1.1)  # the run's own step at 4 sessions
    assert extra[16] == pytest.approx(60.0 - 30.0 * 1.1)
    ratio2 = 1.1 + (24.0 / 20.0 - 1.1) / 3  # the run / calibration ratio, linear in b
    assert extra[2] == pytest.approx(15.0 * ratio2 - 14.0 * 1.1)


def _run(ttft_ms, first_round_ms, tpot_ms, later_ms, tokens=8):
    rounds = [{"verify_ms": first_round_ms, "rejection_ms": 0.0}] + [
        {"verify_ms": later_ms, "rejection_ms": 0.0}] * (tokens - 1)
    return {"start": 0.0, "first": ttft_ms / 1e3, "last": (ttft_ms + tpot_ms * (tokens - 1)) / 1e3,
            "tokens": tokens, "rounds": rounds}


def test_overheads_take_the_gateway_from_fresh_connections_and_the_rest_as_the_hold():
    reused = [_run(80.0, 30.0, 14.0, 15.0)] * 3  # back to back: the first bytes held
    fresh = [_run(42.0, 30.0, 16.5, 15.0)] * 3
    got = overheads(reused, fresh)
    assert got["gateway_ms"] == pytest.approx(12.0)
    assert got["reuse_hold_ms"] == pytest.approx(50.0 - 12.0)
    assert got["step_gap_ms"] == pytest.approx(1.5)  # from the fresh requests
    assert "reuse_hold_ms" not in overheads(reused)  # one pass: as before


def test_a_kept_alive_connection_quicker_than_a_new_one_is_a_negative_hold():
    """Since the gateway's sockets have TCP_NODELAY (7a59555) a reused connection has no hold
    and saves its connect: the difference is kept, not clamped to 0, down to -gateway_ms."""
    reused = [_run(38.0, 30.0, 16.5, 15.0)] * 3
    fresh = [_run(42.0, 30.0, 16.5, 15.0)] * 3
    got = overheads(reused, fresh)
    assert got["gateway_ms"] == pytest.approx(12.0)
    assert got["reuse_hold_ms"] == pytest.approx(-4.0)
    assert overheads([_run(20.0, 30.0, 16.5, 15.0)] * 3, fresh)["reuse_hold_ms"] == -12.0
    base = dict(verify_ms={1: 10.0}, draft_ms={1: 1.0}, gateway_ms=12.0)
    assert Profile("p", "test", reuse_hold_ms=-4.0, **base).reuse_hold_ms == -4.0
    with pytest.raises(ValueError, match="reuse_hold_ms"):
        Profile("p", "test", reuse_hold_ms=-13.0, **base)


def test_a_held_session_gets_its_first_bytes_late_and_the_tokens_made_meanwhile_with_them():
    s = SimSession("s0", None, (), 0.0, gateway_ms=5.0, hold_ms=40.0)
    s.emit(1, 20.0, 0, 0)
    s.emit(1, 35.0, 0, 0)  # made during the hold
    s.emit(1, 80.0, 0, 0)
    assert s.first_ms == 65.0 and s.ttft_ms == 65.0
    assert s.last_ms == 85.0 and s.tpot_ms == pytest.approx(10.0)


def test_closed_loop_clients_pay_the_hold_after_their_first_request():
    cfg = SimConfig(method="none", concurrency=1, requests=4, max_tokens=8, prompt_tokens=32)
    prof = Profile("p", "test", verify_ms={1: 10.0, 64: 100.0}, gateway_ms=4.0,
                   step_overhead_ms=0.0, seq_overhead_ms=0.0)
    held = Profile(**{**prof.to_json(), "reuse_hold_ms": 40.0})
    plain, slow = simulate(cfg, prof), simulate(cfg, held)
    assert slow["ttft_ms_p99"] == pytest.approx(plain["ttft_ms_p99"] + 40.0)
    assert slow["throughput_tok_s"] == pytest.approx(plain["throughput_tok_s"], rel=0.02)


def test_cold_prefills_cost_by_their_own_curve():
    prof = Profile("p", "test", verify_ms={1: 10.0, 64: 100.0}, prefill_ms={1: 10.0, 64: 50.0},
                   step_overhead_ms=0.0, seq_overhead_ms=0.0)
    assert prof.step_ms(64, 1, 0) == pytest.approx(50.0)  # nothing cached: a cold prefill
    assert prof.step_ms(64, 4, 256) == pytest.approx(100.0)


def test_acceptance_leaves_out_each_requests_prefill_round():
    rows = [{"round": 1, "drafted": 0, "accepted": 0}, {"round": 2, "drafted": 3, "accepted": 3},
            {"round": 3, "drafted": 0, "accepted": 0}, {"drafted": 1, "accepted": 1}]
    assert [r.get("round") for r in decode_rounds(rows)] == [2, 3, None]


def test_drive_records_the_warm_passes_requests_and_rounds(tmp_path, monkeypatch):
    import argparse
    import json

    from tools.plan import validate

    def fake(n, tokens=4):
        rounds = [{"method": "none", "round": i + 1, "drafted": 0, "accepted": 0,
                   "verify_ms": 20.0, "rejection_ms": 0.1, "at": 1.05 + i * 0.02}
                  for i in range(tokens)]
        return [{"start": 1.0, "first": 1.05, "last": 1.11, "tokens": tokens,
                 "prompt_tokens": 40, "rounds": [dict(r) for r in rounds]} for _ in range(n)]

    async def cell(url, method, c, arrivals, n, max_tokens, prompts):
        return fake(n)

    async def fresh(url, prompts, max_tokens):
        return fake(len(prompts))
    monkeypatch.setattr(validate, "_cell", cell)
    monkeypatch.setattr(validate, "_fresh", fresh)
    p = argparse.ArgumentParser()
    validate.add_validate_flags(p)
    args = p.parse_args(["--methods", "none", "--concurrency", "1", "--requests", "2"])
    cells = validate.drive(args, "http://x", tmp_path)
    assert set(cells) == {"none|c=1", "none|rate=1/s"}
    over = json.loads((tmp_path / "overhead.json").read_text())
    assert over["reuse_hold_ms"] == 0.0 and over["gateway_ms"] == pytest.approx(29.9)
    reqs = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 4 and reqs[0]["first"] == pytest.approx(0.05)
    rounds = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 16 and rounds[1]["at"] == pytest.approx(0.07)
    assert {r["load"] for r in rounds} == {"c=1", "rate=1/s"}


def test_beyond_the_verifiers_calibration_the_runs_cold_prefills_price_a_step():
    from tools.plan.runprofile import with_prefills

    calibrated = {1: 15.0, 32: 70.0, 64: 130.0, 128: 790.0, 256: 1220.0}
    prefills = [{"prompt_tokens": q, "verify_ms": ms}
                for q, ms in ((45, 60.0), (78, 115.0), (99, 430.0), (127, 480.0), (164, 590.0))]
    got = with_prefills(calibrated, prefills, above=64)
    assert got[32] == 70.0 and got[64] == 130.0  # the verifier's own calibration range kept
    assert 128 not in got and 256 not in got  # calibrate's extension to prefill sizes: replaced
    assert got[78] == 130.0  # never cheaper than 64 tokens
    assert got[99] == 430.0 and got[127] == 480.0 and got[164] == 590.0


def test_the_gateways_loop_shares_itself_among_concurrent_admissions():
    import simpy

    from tools.plan.gateway import SharedLoop

    env = simpy.Environment()
    loop, done = SharedLoop(env), {}

    def req(name, at, work):
        yield env.timeout(at)
        yield loop.admit(work)
        done[name] = env.now
    for i in range(4):  # a burst: each gets a quarter of the loop
        env.process(req(f"b{i}", 0.0, 5.0))
    env.process(req("late", 30.0, 5.0))  # alone: its own work
    env.process(req("mid", 10.0, 5.0))  # joins the burst halfway: 10..20 at 1/4, then 1/1
    env.run()
    assert done["late"] == pytest.approx(35.0)
    # by t=10 the burst jobs have 2.5 ms each left; from 10, five share: the burst's end at
    # 10 + 2.5 * 5 = 22.5; "mid" has had 2.5 of its 5 by then, alone for the rest: 25
    assert all(done[f"b{i}"] == pytest.approx(22.5) for i in range(4))
    assert done["mid"] == pytest.approx(25.0)


def test_an_open_load_takes_its_level_from_its_own_none_steps_by_sessions():
    from tools.plan.runprofile import load_steps

    def row(n, ms, method="none"):
        return {"method": method, "load": "rate=1/s", "round": n, "verify_ms": ms}
    rounds = []
    for i in range(12):  # 12 steps of one session, 12 of two, one prefill step
        rounds += [row(5, 18.0 + i / 100)] + [row(9, 24.0 + i / 100)] * 2
    rounds += [row(1, 40.0)] * 3 + [row(2, 99.0, "ngram")]
    got = load_steps(rounds, "rate=1/s")
    assert got == {1: pytest.approx(18.055), 2: pytest.approx(24.055)}
