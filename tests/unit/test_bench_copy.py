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


def test_page_has_first_asks_repeats_and_the_aggregates():
    rows = _rows({"none": 30.0, "ngram": 60.0, "suffix": 45.0, "auto": 90.0})
    place = {"rows": rows, "first": c.summarise([r for r in rows if r["rep"] == 0]),
             "repeat": c.summarise([r for r in rows if r["rep"] > 0]), **c.summarise(rows)}
    table = c.markdown({"places": {"verifier": place}})
    assert "**copy share >= 0.7**" in table and "**chat** (2 prompts)" in table
    assert "**reformat / extract** (4 prompts)" in table  # each category aggregated too
    assert "| **2.00x** | **1.50x** | **3.00x** |" in table
    assert "identical to plain for every arm and prompt: True" in table


def test_leviathan_bound_uses_the_measured_verify_cost():
    flat = {1: 10.0, 2: 10.0, 9: 10.0}  # verifying is free: the bound is E(a, k)
    assert c.bound(0.5, 2, flat) == pytest.approx(1.75)
    steep = {1: 10.0, 3: 20.0}  # three tokens cost twice one
    assert c.bound(1.0, 2, steep) == pytest.approx(3.0 / 2.0, rel=1e-6)
    rows = _rows({"none": 30.0, "ngram": 60.0, "suffix": 45.0, "auto": 90.0}, reps=1)
    for r in rows:
        r["spec"]["rounds"] = 5
    place = {"rows": rows, "first": c.summarise(rows), "repeat": {}, **c.summarise(rows)}
    lines = c.bound_table({"verify_ms": {"1": 10.0, "4": 20.0}, "places": {"v": place}})
    assert any(line.startswith("| v | auto | 0.80 | 2.0 |") for line in lines), lines
