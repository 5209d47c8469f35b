"""`tandem bench`'s arithmetic and report on synthetic results: no model, no cluster."""
import argparse
import json
import math

import pytest

from tandem.spec.cost import leviathan_speedup
from tools.bench import stats
from tools.bench.config import TANDEM_METHODS
from tools.bench.report import render_markdown, table, write_outputs
from tools.bench.summary import summarize

pytestmark = pytest.mark.unit

# (drafted, accepted, bonus, draft_wait_ms, verify_ms, rejection_ms, gap_ms, committed)
ROUNDS = [(0, 0, True, 0.0, 150.0, 1.0, None, 1),  # prefill round: no gap
          (3, 0, False, 2.0, 60.0, 3.0, 70.0, 1),
          (3, 1, False, 4.0, 60.0, 3.0, 70.0, 2),
          (3, 3, True, 0.0, 62.0, 3.0, 68.0, 4),
          (2, 2, True, 6.0, 60.0, 2.0, 72.0, 3)]


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 0) == 1.0 and stats.percentile(xs, 100) == 5.0
    assert stats.percentile(xs, 99) == pytest.approx(4.96)
    assert stats.percentile([7.0], 99) == 7.0
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError):
        stats.percentile(xs, 101)


def test_decode_tps_and_weighted_throughput():
    assert stats.decode_tps(11, 1.0, 2.0) == 10.0
    assert math.isnan(stats.decode_tps(1, 1.0, 2.0))
    runs = [{"tokens": 11, "decode_tps": 10.0}, {"tokens": 101, "decode_tps": 50.0}]
    # total tokens over total time (10 + 100 tokens in 1 + 2 s), not the mean of the rates
    assert stats.throughput(runs) == pytest.approx(110 / 3)


def test_per_position_rates_are_conditional_on_reaching_the_position():
    rates = stats.per_position_rates(ROUNDS, 4)
    assert rates[:3] == pytest.approx([3 / 4, 2 / 3, 1 / 1])
    assert math.isnan(rates[3])  # no round drafted 4 tokens


def test_alpha_counts_rejections_not_unverified_drafts():
    # accepted 0+1+3+2 = 6, rejections in the two rounds that stopped early
    assert stats.acceptance_alpha(ROUNDS) == pytest.approx(6 / 8)
    s = stats.spec_summary(ROUNDS, 4)
    assert s["acceptance_rate"] == pytest.approx(6 / 11)
    assert s["mean_k"] == pytest.approx(11 / 4)
    assert s["mean_accepted_length"] == pytest.approx(11 / 5)


@pytest.mark.parametrize("alpha,k,c", [(0.6, 4, 0.05), (0.8, 8, 0.02), (0.3, 1, 0.5)])
def test_leviathan_bound_matches_the_formula(alpha, k, c):
    expected = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))
    assert stats.leviathan_bound(alpha, k, c) == pytest.approx(expected)
    assert stats.leviathan_bound(alpha, k, c) == pytest.approx(leviathan_speedup(alpha, k, c))


def test_leviathan_bound_edges_and_fractional_k():
    assert stats.leviathan_bound(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert stats.leviathan_bound(1.0, 4, 0.0) == pytest.approx(5.0)
    assert stats.leviathan_bound(0.5, 0, 0.1) == 1.0
    lo, mid, hi = (stats.leviathan_bound(0.7, k, 0.0) for k in (2, 2.5, 3))
    assert lo < mid < hi
    assert math.isnan(stats.leviathan_bound(math.nan, 4, 0.1))
    k, s = stats.best_bound(0.9, 8, 0.05)
    assert s == max(stats.leviathan_bound(0.9, j, 0.05) for j in range(1, 9)) and 1 <= k <= 8


def test_round_breakdown_leaves_out_the_prefill_and_keeps_the_rest():
    b = stats.round_breakdown(ROUNDS)
    assert b["rounds"] == 4
    assert b["gap_ms"] == pytest.approx(70.0)
    assert b["draft_wait_ms"] == pytest.approx(3.0) and b["verify_ms"] == pytest.approx(60.5)
    assert b["other_ms"] == pytest.approx(70.0 - 3.0 - 60.5 - 2.75)


def test_itl_spreads_a_chunk_over_its_tokens():
    assert stats.itl_samples([0.0, 0.1, 0.4], [1, 1, 3]) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def _run(system, method, temp, cat, tps, grounded=False, spec=None):
    return {"system": system, "method": method, "temperature": temp, "prompt_id": cat + "-1",
            "category": cat, "grounded": grounded, "tokens": 65, "decode_tps": tps,
            "ttft_s": 0.2, **({"speculation": spec} if spec else {})}


# Total tokens/s by level, then method: none scales 9x at 16 sessions; ngram loses at 16.
CONC_TPS = {1: {"none": 16.0, "draft_model": 30.0, "ngram": 17.0},
            4: {"none": 56.0, "draft_model": 80.0, "ngram": 57.0},
            16: {"none": 144.0, "draft_model": 150.0, "ngram": 130.0}}


def _conc(n, method, tps):
    row = {"sessions": n, "tokens": 64 * n, "wall_s": 64 * n / tps, "total_tps": tps,
           "itl_p50_ms": 60.0 + n, "itl_p99_ms": 120.0 + n, "ttft_p50_s": 0.2,
           "ttft_p99_s": 0.4, "session_decode_tps": [16.0] * n}
    return {**row, "method": method, "temperature": 0.0} if method else row


def synthetic_result() -> dict:
    runs = []
    for cat, grounded in (("chat", False), ("copy_list", True)):
        runs += [_run("transformers", "plain", 0.0, cat, 13.0, grounded),
                 _run("transformers", "assisted", 0.0, cat, 18.0, grounded),
                 _run("transformers", "prompt_lookup", 0.0, cat, 20.0, grounded),
                 _run("tandem", "none", 0.0, cat, 16.0, grounded),
                 _run("tandem", "draft_model", 0.0, cat, 32.0, grounded,
                      {"drafted_tokens": 80, "accepted_tokens": 60, "rounds": 25}),
                 _run("tandem", "ngram", 0.0, cat, 19.0 if grounded else 16.0, grounded,
                      {"drafted_tokens": 40, "accepted_tokens": 20, "rounds": 40})]
    rounds = [{"system": "tandem-grpc", "method": m, "temperature": 0.0, "prompt_id": "chat-1",
               "category": "chat", "grounded": False, "tokens": 12, "decode_tps": 30.0,
               "ttft_s": 0.2, "rounds": ROUNDS} for m in ("draft_model", "ngram")]
    plain = [(0, 0, True, 0.0, 150.0, 1.0, None, 1)] + [(0, 0, True, 0.0, 55.0, 1.0, 60.0, 1)] * 4
    rounds.append({**rounds[0], "method": "none", "rounds": plain})
    conc = [_conc(n, m, tps) for n, by_method in CONC_TPS.items()
            for m, tps in by_method.items()]
    meta = {"date": "2026-11-21 13:40 UTC", "finished": "2026-11-21 13:44 UTC",
            "machine": {"cpu": "test cpu", "cores": 2, "torch": "2", "transformers": "5",
                        "python": "3.11", "load_avg_at_start": [0.1, 0.2, 0.3]},
            "config": {"k": 4, "max_tokens": 64, "threads": 1, "quick": True},
            "target": "/x/SmolLM2-135M-Instruct", "draft": "/x/draft",
            "prompt_tokens": {"chat-1": 30, "copy_list-1": 60},
            "cost": {"draft_ms": 2.0, "target_ms": 40.0, "c": 0.05}}
    return {"meta": meta, "runs": runs, "rounds": rounds, "concurrency": conc}


def test_summary_speedups_bound_and_targets():
    s = summarize(synthetic_result())
    assert s["speedup"][("tandem", "draft_model", 0.0)]["all"] == pytest.approx(2.0)
    spec = s["speculation"][("draft_model", 0.0)]
    assert spec["alpha"] == pytest.approx(0.75) and spec["alpha_source"] == "rounds"
    assert spec["bound"] == pytest.approx(stats.leviathan_bound(0.75, 11 / 4, 0.05))
    assert spec["of_bound"] == pytest.approx(2.0 / spec["bound"])
    assert spec["acceptance_rate"] == pytest.approx(0.75)  # gateway totals: 120 / 160
    t = {x["name"].split(",")[0]: x for x in s["targets"]}
    assert t["best method (draft_model) >= 1.8x Tandem plain"]["met"] is True
    assert t["Tandem draft_model >= transformers assisted"]["measured"] == pytest.approx(32 / 18)
    ngram = t["Tandem ngram >= transformers prompt lookup"]
    assert ngram["measured"] == pytest.approx(19 / 20) and ngram["met"] is False
    conc = [x for x in s["targets"] if "concurrent" in x["name"]][0]
    assert conc["measured"] == pytest.approx(9.0) and conc["met"] is True


def test_table_and_markdown_render():
    assert table(["a", "b"], [["x", "1"]]).splitlines() == ["| a | b |", "|:---|---:|",
                                                            "| x | 1 |"]
    result = synthetic_result()
    md = render_markdown(result, summarize(result), "img/")
    assert "# Tandem benchmarks" in md and "test cpu" in md and "2026-11-21 13:40 UTC" in md
    assert "| Tandem draft_model, T=0 |" in md and "**32.0**" in md
    assert "![concurrency](img/bench-concurrency.png)" in md
    assert "**missed**" in md and "| met |" in md


def test_breakdown_explains_the_gateway_hop_per_token():
    result = synthetic_result()
    s = summarize(result)
    assert s["plain_rounds"][0.0]["gap_ms"] == pytest.approx(60.0)
    md = render_markdown(result, s, "img/")
    # plain: 60 ms per round direct, 1000 / 16 = 62.5 ms per token through the gateway
    assert "| plain (none), T=0 | 60.0 | 0.0 | 55.0 | 1.0 | 4.0 | 1.00 | 4 | 60.0 | 62.5 | 2.5 |" \
        in md
    # draft_model: 70 ms rounds / 2.2 tokens direct, 1000 / 32 through the gateway
    row = [ln for ln in md.splitlines() if ln.startswith("| draft_model, T=0 | 70.0")][0]
    assert row.endswith(f"| {70 / 2.2:.1f} | 31.2 | {31.25 - 70 / 2.2:.1f} |")


def test_write_outputs_writes_json_markdown_and_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    out, docs = tmp_path / "results" / "bench-x", tmp_path / "docs"
    write_outputs(synthetic_result(), out, docs)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "bench-concurrency.png" in pngs
    assert len(pngs) == 4 and sorted(p.name for p in (docs / "img").glob("*.png")) == pngs
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    saved = json.loads((out / "results.json").read_text())
    assert saved["summary"]["speedup"]["tandem draft_model 0.0"]["all"] == pytest.approx(2.0)
    assert "img/bench-speedup.png" in (docs / "benchmarks.md").read_text()
    assert "(bench-speedup.png)" in (out / "report.md").read_text()


def test_report_re_renders_from_saved_json(tmp_path):
    pytest.importorskip("matplotlib")
    from tools.bench.cli import register

    write_outputs(synthetic_result(), tmp_path, None)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--report", str(tmp_path / "results.json"),
                              "--docs", str(tmp_path / "docs")])
    assert args.func(args) == 0
    assert (tmp_path / "docs" / "benchmarks.md").is_file()


def test_quick_flags_build_the_quick_config():
    from tools.bench.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["bench", "--quick", "--concurrency", "1,2"]))
    assert cfg.quick and cfg.max_tokens == 64 and cfg.per_category == 1
    assert cfg.peer_temperatures == (0.0,) and cfg.concurrency == (1, 2)
    assert cfg.concurrency_methods == ("none", "ngram", "draft_model")
    full = config_from_args(parser.parse_args(["bench"]))
    assert full.max_tokens == 128 and full.concurrency == (1, 4, 16, 32)
    assert full.concurrency_methods == TANDEM_METHODS and full.concurrency_methods[0] == "none"
    short = config_from_args(parser.parse_args(["bench", "--quick", "--concurrency-methods",
                                                "none, suffix"]))
    assert short.concurrency_methods == ("none", "suffix") and short.concurrency == (1, 4, 8)
    with pytest.raises(ValueError, match="concurrency methods"):
        config_from_args(parser.parse_args(["bench", "--concurrency-methods", "none,bogus"]))
    greedy = config_from_args(parser.parse_args(["bench", "--temperatures", "0",
                                                 "--peer-temperatures", "0",
                                                 "--round-temperatures", ""]))
    assert greedy.temperatures == greedy.peer_temperatures == (0.0,)
    assert greedy.round_temperatures == ()


def test_breakdown_by_k_groups_rounds_and_counts_tokens():
    from tools.bench.stats import breakdown_by_k

    rows = [(2, 2, True, 1.0, 40.0, 1.0, 50.0, 3), (2, 0, False, 1.0, 40.0, 1.0, 46.0, 1),
            (0, 0, True, 0.0, 35.0, 0.5, 40.0, 1), (4, 4, True, 2.0, 45.0, 1.0, None, 5)]
    by_k = breakdown_by_k(rows)
    assert sorted(by_k) == [0, 2]  # the first round (no gap: the prefill) is left out
    assert by_k[2]["rounds"] == 2 and by_k[2]["tokens_per_round"] == 2.0
    assert by_k[2]["gap_ms"] == 48.0 and by_k[2]["other_ms"] == 48.0 - 42.0


def test_repetitive_workload_summary_and_report(tmp_path):
    from tools.bench import repetitive

    prompts = [{"id": "chat-1", "category": "chat", "grounded": False, "prompt": "a"},
               {"id": "story-1", "category": "story", "grounded": False, "prompt": "b"},
               {"id": "code-1", "category": "code", "grounded": True, "prompt": "c"}]
    reqs = repetitive.workload(prompts, 2)
    assert [(r["id"], r["ask"]) for r in reqs] == [("chat-1", 0), ("code-1", 0),
                                                   ("chat-1", 1), ("code-1", 1)]

    def row(r, method, secs, drafted=0, accepted=0, rounds=10):
        spec = {"rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted}
        return repetitive._row(r, "tandem", method, {"tokens": 10, "e2e_s": secs,
                                                     "speculation": spec})
    rows = [row(r, "none", 1.0) for r in reqs]
    # suffix: as fast as plain on first asks, 4x on repeats
    rows += [row(r, "suffix", 1.0 if r["ask"] == 0 else 0.25, 8, 6 if r["ask"] else 0,
                 10 if r["ask"] == 0 else 3) for r in reqs]
    result = {"meta": {"date": "d", "machine": {"cpu": "x", "cores": 2, "torch": "t",
                                                 "load_avg_at_start": [0.0, 0.0, 0.0]},
                       "config": {"max_tokens": 10, "k": 16}, "repeats": 2, "requests": 4,
                       "workload": "repetitive"}, "rows": rows}
    s = repetitive.summarize(result)
    suffix = s[("tandem", "suffix")]
    assert suffix["first"]["speedup"] == pytest.approx(1.0)
    assert suffix["repeat"]["speedup"] == pytest.approx(4.0)
    assert suffix["all"]["speedup"] == pytest.approx(40 / 2.5 / 10)  # 40 tokens in 2.5 s
    assert suffix["repeat"]["acceptance"] == pytest.approx(0.75)
    docs = tmp_path / "docs"
    repetitive.write_outputs(result, tmp_path / "out", docs)
    md = (docs / "benchmarks-repetitive.md").read_text()
    assert "| Tandem suffix | 16.0 | 1.60x | 1.00x | 4.00x |" in md
    assert (docs / "img" / "bench-repetitive.png").stat().st_size > 0
