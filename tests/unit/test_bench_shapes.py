"""`tandem bench`'s chain-vs-tree phase on synthetic results: no model, no cluster."""
import argparse
import math

import pytest
from test_bench_report import synthetic_result

from tools.bench import shapes
from tools.bench.report import render_markdown, write_outputs
from tools.bench.summary import summarize

pytestmark = pytest.mark.unit

# Forward ms by tokens per forward: a 9-token verify costs 2.5x a 1-token step.
CURVE = {1: 20.0, 2: 21.0, 3: 24.0, 5: 30.0, 9: 50.0, 17: 80.0}
# (method, shape): tokens/s, rounds, drafted, accepted for 64 tokens per request.
PHASE = {("none", None): (16.0, 64, 0, 0),
         ("eagle", "chain"): (20.0, 32, 64, 32),  # 2 tokens/round, 2 drafts verified
         ("eagle", "tree"): (24.0, 24, 192, 40),  # 64/24 tokens/round, 8 nodes
         ("medusa", "chain"): (18.0, 40, 40, 24),
         ("medusa", "tree"): (36.0, 20, 80, 44)}  # 3.2 tokens/round, 4 nodes


def _row(method, shape, prompt, tps, rounds, drafted, accepted):
    return {"system": "tandem", "method": method, "shape": shape, "temperature": 0.0,
            "prompt_id": prompt, "category": prompt.split("-")[0], "grounded": False,
            "tokens": 64, "decode_tps": tps, "ttft_s": 0.2,
            "speculation": {"rounds": rounds, "drafted_tokens": drafted,
                            "accepted_tokens": accepted}}


def shape_result(phase=PHASE, skipped=None) -> dict:
    result = synthetic_result()
    # two prompts, the same figures: rates and ratios stay those of one
    result["shapes"] = [_row(m, s, p, *v) for p in ("chat-1", "code-1")
                        for (m, s), v in phase.items()]
    result["meta"]["cost_verify"] = {"ms": {str(q): v for q, v in CURVE.items()},
                                     "threads": 1}  # as results.json stores it
    result["meta"]["shapes_skipped"] = skipped or {}
    return result


def test_relative_cost_interpolates_between_measured_points():
    assert shapes.relative_cost(CURVE, 1) == 1.0
    assert shapes.relative_cost(CURVE, 9) == pytest.approx(2.5)
    assert shapes.relative_cost(CURVE, 4) == pytest.approx(27.0 / 20)  # between 3 and 5
    assert shapes.relative_cost(CURVE, 3.5) == pytest.approx(25.5 / 20)
    assert shapes.relative_cost(CURVE, 34) == pytest.approx(160.0 / 20)  # past 17: ∝ q
    assert math.isnan(shapes.relative_cost({}, 3))
    assert shapes.cost_curve({"cost_verify": {"ms": {"1": 20.0, "9": 50.0}}}) == \
        {1: 20.0, 9: 50.0}
    assert shapes.cost_curve({}) == {}


def test_bound_is_tokens_per_round_over_the_relative_verify_cost():
    # 3.2 tokens per round, 4 nodes verified: cost(5) / cost(1) = 1.5
    assert shapes.shape_bound(3.2, 4.0, CURVE) == pytest.approx(3.2 / 1.5)
    assert shapes.shape_bound(1.0, 0.0, CURVE) == pytest.approx(1.0)  # plain decoding
    assert math.isnan(shapes.shape_bound(3.2, 4.0, {}))
    assert math.isnan(shapes.shape_bound(math.nan, math.nan, CURVE))


def test_table_rows_tokens_per_round_speedup_and_bound():
    s = summarize(shape_result())
    rows = s["shapes"]
    assert [(r["method"], r["shape"]) for r in rows] == list(PHASE)  # plain, then chain/tree
    by = {(r["method"], r["shape"]): r for r in rows}
    tree = by[("medusa", "tree")]
    assert tree["requests"] == 2 and tree["rounds"] == 40 and tree["tokens"] == 128
    assert tree["tokens_per_round"] == pytest.approx(3.2)
    assert tree["mean_verified"] == pytest.approx(4.0)
    assert tree["acceptance"] == pytest.approx(44 / 80)
    assert tree["speedup"] == pytest.approx(36 / 16)
    assert tree["bound"] == pytest.approx(3.2 / 1.5)
    eagle = by[("eagle", "tree")]
    assert eagle["tokens_per_round"] == pytest.approx(64 / 24)
    assert eagle["bound"] == pytest.approx(64 / 24 / 2.5)  # 8 nodes: cost(9) = 2.5 x cost(1)
    plain = by[("none", None)]
    assert plain["speedup"] == pytest.approx(1.0) and plain["bound"] == pytest.approx(1.0)


def _shape_targets(s) -> dict:
    return {t["name"]: t for t in s["targets"][-3:]}


def test_targets_met():
    t = _shape_targets(summarize(shape_result()))
    medusa = t["medusa >= 2.5 committed tokens per round (tree)"]
    assert medusa["measured"] == pytest.approx(3.2) and medusa["met"] is True
    eagle = t["eagle tree >= 2.5 committed tokens per round"]
    assert eagle["measured"] == pytest.approx(64 / 24) and eagle["met"] is True
    best = t["best method >= 2.0x plain through the gateway, greedy"]
    # medusa tree 2.25x beats the single-session phase's best (draft_model, 2.0x)
    assert best["measured"] == pytest.approx(36 / 16) and best["met"] is True
    assert best["note"] == "medusa tree (chain-vs-tree phase)"


def test_targets_missed_and_not_measured():
    slow = {**PHASE, ("medusa", "tree"): (20.0, 32, 80, 32)}  # 2 tokens per round
    del slow[("eagle", "chain")], slow[("eagle", "tree")]
    result = shape_result(slow, {"eagle": "no EAGLE head in this run"})
    result["runs"] = [r for r in result["runs"] if r["method"] != "draft_model"]
    t = _shape_targets(summarize(result))
    medusa = t["medusa >= 2.5 committed tokens per round (tree)"]
    assert medusa["measured"] == pytest.approx(2.0) and medusa["met"] is False
    eagle = t["eagle tree >= 2.5 committed tokens per round"]
    assert eagle["met"] is None and eagle["note"] == "not run: no EAGLE head in this run"
    best = t["best method >= 2.0x plain through the gateway, greedy"]
    assert best["measured"] == pytest.approx(20 / 16) and best["met"] is False
    assert best["note"] == "medusa tree (chain-vs-tree phase)"


def test_report_section_table_formula_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    result = shape_result()
    md = render_markdown(result, summarize(result), "img/")
    assert "## Chain vs tree (greedy, through the gateway)" in md
    assert "| medusa | tree | 2 | 3.20 | 0.55 | 4.00 | 36.0 | 2.25x | 2.13x |" in md
    assert "| plain (none) | – | 2 | 1.00 | – | 0.00 | 16.0 | 1.00x | 1.00x |" in md
    assert "x cost(1) / cost(nodes verified / round + 1)" in md
    assert "leaves out the drafting wait" in md and "9: 2.50" in md
    assert "![chain vs tree](img/bench-chain-vs-tree.png)" in md
    s = write_outputs(result, tmp_path, None)
    assert (tmp_path / shapes.PLOT).stat().st_size > 5000 and len(s["shapes"]) == 5


def test_results_without_the_phase_say_so():
    result = synthetic_result()  # from before the phase: no "shapes", no curve
    md = render_markdown(result, summarize(result), "img/")
    assert "## Chain vs tree" in md and "Not run" in md and "chain-vs-tree.png" not in md
    t = _shape_targets(summarize(result))
    assert t["medusa >= 2.5 committed tokens per round (tree)"]["met"] is None
    assert t["best method >= 2.0x plain through the gateway, greedy"]["met"] is True


def test_available_skips_methods_without_heads():
    assert shapes.available(("eagle", "medusa"), "/heads", True) == (("eagle", "medusa"), {})
    runs, skipped = shapes.available(("eagle", "medusa"), "", False)
    assert runs == () and set(skipped) == {"eagle", "medusa"}
    assert shapes.configs(("medusa",)) == [("none", None), ("medusa", "chain"),
                                           ("medusa", "tree")]


def test_phase_interleaves_configs_per_prompt_and_records_failures(monkeypatch):
    from tools.bench import client, config, phases

    calls = []

    def fake_single(url, body):
        spec = body["speculation"]
        calls.append((body["messages"][0]["content"], spec["method"], spec.get("draft_shape")))
        if body["max_tokens"] > 8 and (spec["method"], spec.get("draft_shape")) == \
                ("eagle", "tree") and body["messages"][0]["content"] == "b":
            raise RuntimeError("boom")
        return {"tokens": body["max_tokens"], "decode_tps": 20.0, "ttft_s": 0.1,
                "e2e_s": 1.0, "speculation": {"rounds": 4}}

    class Bar:
        def set_description(self, _):
            pass

        def update(self):
            pass

    monkeypatch.setattr(client, "run_single", fake_single)
    cfg = config.quick_config(shape_prompts=2)
    prompts = [{"id": i, "prompt": i, "category": "chat", "grounded": False} for i in "abc"]
    ctx = phases.Ctx(cfg, prompts, {}, "t", "d", Bar(), None, {"meta": {}, "shapes": []})
    shapes.run_shapes(ctx, "http://x", ("eagle",))
    order = [("none", None), ("eagle", "chain"), ("eagle", "tree")]
    assert calls == [("a", *c) for c in order] * 2 + [("b", *c) for c in order]
    rows = ctx.result["shapes"]
    assert [(r["prompt_id"], r["method"], r["shape"]) for r in rows] == [
        ("a", *c) for c in order] + [("b", "none", None), ("b", "eagle", "chain")]
    assert ctx.result["meta"]["errors"] == ["shapes eagle tree b: RuntimeError('boom')"]
    assert shapes.jobs(cfg, 5, ("eagle",)) == 6 and shapes.jobs(cfg, 5, ()) == 0


def test_shape_methods_flag():
    from tools.bench.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    quick = config_from_args(parser.parse_args(["bench", "--quick"]))
    assert quick.shape_methods == ("eagle", "medusa") and quick.shape_prompts == 3
    full = config_from_args(parser.parse_args(["bench", "--shape-methods", "medusa"]))
    assert full.shape_methods == ("medusa",) and full.shape_prompts == 0
    assert config_from_args(parser.parse_args(["bench", "--shape-methods", ""])) \
        .shape_methods == ()
    with pytest.raises(ValueError, match="shape methods"):
        config_from_args(parser.parse_args(["bench", "--shape-methods", "ngram"]))
