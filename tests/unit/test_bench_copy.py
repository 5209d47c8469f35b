"""The copy-heavy workload's arithmetic (tools/bench/copy_report.py), without a cluster: copy
share, speedups against plain on the same prompts, first asks apart from repeats, and the
aggregate rows of the page."""
import pytest

from tools.bench import copy_report as c

pytestmark = pytest.mark.unit


def test_copy_share_counts_the_answers_spans_found_in_the_prompt():
    prompt = "Repeat: the quick brown fox jumps over the lazy dog."
    assert c.copy_share("the quick brown fox jumps", prompt) == 1.0
    assert c.copy_share("zzzzzzzzzzzzzzzzzzzz", prompt) == 0.0
    assert c.copy_share("short", prompt) == 0.0  # no 12-character span at all


def _rows(speed: dict[str, float], reps: int = 2) -> list[dict]:
    """Every prompt and arm: 60 tokens at the arm's tokens/s, plain's text everywhere."""
    return [{"rep": rep, "prompt": i, "arm": arm, "text": c.PROMPTS[i][-60:], "tokens": 60,
             "wall_s": 60 / speed[arm], "spec": {"drafted_tokens": 10, "accepted_tokens": 8}}
            for rep in range(reps) for i in range(len(c.PROMPTS)) for arm in speed]


def test_speedups_are_against_plain_on_the_same_prompts():
    rows = _rows({"none": 30.0, "ngram": 60.0, "suffix": 45.0, "auto": 90.0})
    s = c.summarise(rows)
    assert s["overall"]["ngram"]["speedup"] == pytest.approx(2.0)
    assert s["overall"]["auto"]["speedup"] == pytest.approx(3.0)
    assert s["overall"]["suffix"]["acceptance"] == pytest.approx(0.8)
    assert all(a["identical_to_plain"] for a in s["overall"].values())
    assert s["per_prompt"]["0"]["copy_share"] == 1.0  # the answer is the prompt's tail
    rows[5]["text"] = "something else entirely"
    assert not c.summarise(rows)["overall"][rows[5]["arm"]]["identical_to_plain"]
    assert c.summarise([]) == {}


def _place(speed: dict[str, float], reps: int = 2) -> dict:
    rows = _rows(speed, reps)
    return {"rows": rows, "first": c.summarise([r for r in rows if r["rep"] == 0]),
            "repeat": c.summarise([r for r in rows if r["rep"] > 0]), **c.summarise(rows)}


def test_page_has_first_asks_repeats_and_the_aggregates():
    place = _place({"none": 30.0, "ngram": 60.0, "suffix": 45.0, "auto": 90.0})
    table = c.markdown({"places": {"verifier": place}})
    assert "**copy share >= 0.7**" in table and "**chat** (2 prompts)" in table
    assert "**reformat / extract** (4 prompts)" in table  # each category aggregated too
    # ngram, suffix, auto, then auto over the best single method (ngram's 2.00x)
    assert "| **2.00x** | **1.50x** | **3.00x** | **1.50x** |" in table
    assert "identical to plain for every arm and prompt: True" in table
    assert "not below plain in every category: True" in table


def test_the_verdict_names_a_category_where_auto_trails_the_best_method():
    place = _place({"none": 30.0, "ngram": 60.0, "medusa": 40.0, "auto": 57.0}, reps=1)
    chat = [i for i, cat in enumerate(c.CATEGORIES) if cat == "chat"]
    for r in place["rows"]:  # on chat auto is below plain
        if r["prompt"] in chat and r["arm"] == "auto":
            r["wall_s"] = 60 / 29.0
    place["first"] = c.summarise(place["rows"])
    verdict = c.auto_verdict({"places": {"verifier": place}})
    assert "every category: False" in verdict and "chat, 0.97x plain" in verdict


def test_leviathan_bound_and_ceiling_use_the_measured_verify_cost():
    flat = {1: 10.0, 2: 10.0, 9: 10.0}  # verifying is free: the bound is E(a, k) at k = 8
    assert c.bound(0.5, flat, max_spec_tokens=8)[0] == pytest.approx(2 - 0.5 ** 8)
    steep = {1: 10.0, 3: 20.0, 5: 30.0}  # every token costs 5 ms more
    b, k = c.bound(0.9, steep, max_spec_tokens=4)
    rates = [(1 - 0.9 ** (j + 1)) / 0.1 / ((10 + 5 * j) / 10) for j in range(5)]
    assert b == pytest.approx(max(rates)) and k == rates.index(max(rates))
    # 100 tokens in 25 rounds verifying 75 drafts: (5 + 5) * 100 / (25 * 5 + 5 * 100)
    assert c.ceiling(100, 25, 75, steep) == pytest.approx(1000 / 625)
    assert c.ceiling(100, 100, 0, steep) == pytest.approx(1.0)  # plain decoding
    place = _place({"none": 30.0, "ngram": 60.0, "suffix": 45.0, "auto": 90.0}, reps=1)
    for r in place["rows"]:
        r["spec"]["rounds"] = 5
    lines = c.bound_table({"verify_ms": {"1": 10.0, "4": 20.0}, "places": {"v": place}})
    assert any(line.startswith("| v | auto | 0.80 | 2.0 |") for line in lines), lines


def test_layer_skip_is_an_opt_in_arm_and_a_subset_of_prompts_renders(monkeypatch):
    from tools.bench import copy_heavy

    asked = []
    monkeypatch.setattr(copy_heavy, "Cluster", _FakeCluster)
    monkeypatch.setattr(copy_heavy, "served_model", lambda url: "m")

    def ask(url, prompt, arm, *a, **kw):
        if prompt in c.PROMPTS:  # not the warm-up
            asked.append((c.PROMPTS.index(prompt), arm))
        return {"text": prompt[-60:], "wall_s": 1.0, "tokens": 60, "spec": {}}

    monkeypatch.setattr(copy_heavy, "ask", ask)
    copy_heavy.run_place("verifier", 1, 60, 0.0)
    assert "layer_skip" not in {arm for _, arm in asked}  # not by default
    asked.clear()
    place = copy_heavy.run_place("verifier", 1, 60, 0.0, ("layer_skip",), picks=(3, 12))
    assert sorted(set(asked)) == [(i, a) for i in (3, 12) for a in ("layer_skip", "none")]
    table = c.markdown({"places": {"verifier": place}})
    assert "| layer_skip |" in table.splitlines()[0] and "**chat** (1 prompts)" in table


class _FakeCluster:
    gateway_url = "http://fake"

    def __init__(self, *a, **kw):
        pass

    def start(self):
        pass

    def stop(self):
        pass


def test_tandem_bench_copy_passes_the_workload_flags_through(monkeypatch, tmp_path):
    """`tandem bench --workload copy` takes what benchmarks/copy_heavy.py took (it replaced it):
    where ngram and suffix draft, the arms, first asks, prompts and the temperature."""
    import argparse

    from tools.bench import copy_heavy
    from tools.bench.cli import register

    seen = {}
    monkeypatch.setattr(copy_heavy, "run_workload", lambda *a, **kw: seen.update(a=a, kw=kw))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--workload", "copy", "--history", "verifier",
                              "--repeats", "1", "--first-reps", "2", "--arms", "ngram,auto",
                              "--prompts", "7,10", "--temperatures", "0.7", "--max-tokens",
                              "128", "--docs", "", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert seen["a"] == (128, 1)
    kw = seen["kw"]
    assert kw["places"] == ("verifier",) and kw["arms"] == ("ngram", "auto")
    assert kw["first_reps"] == 2 and kw["picks"] == (7, 10) and kw["temperature"] == 0.7
    assert kw["docs"] is None and kw["out"] == tmp_path / "results.json"
    args = parser.parse_args(["bench", "--workload", "copy", "--temperatures", "0,0.7"])
    assert args.func(args) == 2  # the copy workload runs at one temperature
