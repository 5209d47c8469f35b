"""From a run's raw JSON to the figures the report shows and the targets it checks.

Pure Python, like stats.py: a saved results.json can be re-summarised without a model.
"""
from __future__ import annotations

import math
from collections import defaultdict

from tandem.spec.methods import Method
from tools.bench.config import SPEC_METHODS
from tools.bench.shapes import cost_curve, shapes_table
from tools.bench.stats import (
    best_bound,
    breakdown_by_k,
    leviathan_bound,
    ratio,
    round_breakdown,
    spec_summary,
    throughput,
)

# (system, method) in the order the tables list them, with their display names.
LABELS = {("transformers", "plain"): "transformers generate",
          ("transformers", "assisted"): "transformers assisted (draft)",
          ("transformers", "prompt_lookup"): "transformers prompt lookup",
          ("tandem", Method.NONE.api_name): "Tandem plain (none)",
          **{("tandem", m): f"Tandem {m}" for m in SPEC_METHODS}}
BASELINE = ("tandem", Method.NONE.api_name)
NONE = Method.NONE.api_name
OLD_CONCURRENCY_METHOD = Method.DRAFT_MODEL.api_name  # rows from before each had its method
SCALING_GOAL, SCALING_LEVEL, NO_LOSS_GOAL = 8.0, 16, 0.95
TREE_TOKENS_GOAL, BEST_GOAL = 2.5, 2.0  # issue 11, on this CPU


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def throughput_table(runs: list[dict]) -> dict:
    """{(system, method, temperature): {"all", "grounded", "ttft_s", "by_category": {...}}}."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["system"], r["method"], r["temperature"])].append(r)
    out = {}
    for key, rs in groups.items():
        cats = defaultdict(list)
        for r in rs:
            cats[r["category"]].append(r)
        out[key] = {"all": throughput(rs), "grounded": throughput(r for r in rs if r["grounded"]),
                    "ttft_s": _mean(r["ttft_s"] for r in rs), "n": len(rs),
                    "by_category": {c: throughput(v) for c, v in cats.items()}}
    return out


def speedups(table: dict) -> dict:
    """Every row's tokens/s over Tandem plain at the same temperature, overall and per
    category (the same gateway, so only speculation differs)."""
    out = {}
    for (system, method, temp), row in table.items():
        base = table.get((*BASELINE, temp))
        if base is None:
            continue
        out[(system, method, temp)] = {
            "all": ratio(row["all"], base["all"]),
            "by_category": {c: ratio(v, base["by_category"].get(c, math.nan))
                            for c, v in row["by_category"].items()}}
    return out


def _gateway_acceptance(runs: list[dict], method: str, temp: float,
                        category: str | None = None) -> dict:
    rs = [r for r in runs if (r["system"], r["method"], r["temperature"]) ==
          ("tandem", method, temp) and r.get("speculation")
          and category in (None, r["category"])]
    drafted = sum(r["speculation"].get("drafted_tokens", 0) for r in rs)
    accepted = sum(r["speculation"].get("accepted_tokens", 0) for r in rs)
    rounds = sum(r["speculation"].get("rounds", 0) for r in rs)
    return {"acceptance_rate": accepted / drafted if drafted else math.nan,
            "mean_accepted_length": sum(r["tokens"] for r in rs) / rounds if rounds else math.nan}


def speculation_table(result: dict, table: dict) -> dict:
    """Per (method, temperature): acceptance (gateway totals; per-position and a from the
    verifier's rounds where measured), Leviathan's bound and the measured speedup."""
    k = result["meta"]["config"]["k"]
    costs = {"draft_model": (result["meta"].get("cost") or {}).get("c", math.nan),
             "eagle": (result["meta"].get("cost_eagle") or {}).get("c", math.nan),
             "layer_skip": (result["meta"].get("cost_layer_skip") or {}).get("c", math.nan)}
    out = {}
    temps = sorted({r["temperature"] for r in result["runs"] if r["system"] == "tandem"} |
                   {r["temperature"] for r in result["rounds"]})
    for method in SPEC_METHODS:
        c = costs.get(method, 0.0)  # a lookup costs no forward
        for temp in temps:
            rows = [x for r in result["rounds"] if (r["method"], r["temperature"]) ==
                    (method, temp) for x in r["rounds"]]
            gw = _gateway_acceptance(result["runs"], method, temp)
            rs = spec_summary(rows, k) if rows else {}
            alpha = rs.get("alpha", gw["acceptance_rate"])  # accepted/drafted if no rounds
            mean_k = rs["mean_k"] if rows else k
            measured = ratio(table.get(("tandem", method, temp), {}).get("all", math.nan),
                             table.get(("tandem", "none", temp), {}).get("all", math.nan))
            bound = leviathan_bound(alpha, mean_k, c)
            best_k, best = best_bound(alpha, k, c)
            out[(method, temp)] = {
                **gw, "alpha": alpha, "alpha_source": "rounds" if rows else "gateway",
                "per_position": rs.get("per_position", []), "mean_k": mean_k, "c": c,
                "spec_share": ratio(rs.get("spec_rounds", math.nan), rs.get("rounds", math.nan)),
                "bound": bound, "best_k": best_k, "best_bound": best, "measured": measured,
                "of_bound": ratio(measured, bound), "breakdown": round_breakdown(rows),
                "breakdown_by_k": breakdown_by_k(rows),
                "rounds_mean_accepted_length": rs.get("mean_accepted_length", math.nan)}
    return out


def plain_rounds(result: dict) -> dict:
    """Per temperature: the direct verifier rounds of plain decoding (method none)."""
    by_temp: dict[float, list] = {}
    for r in result["rounds"]:
        if r["method"] == Method.NONE.api_name:
            by_temp.setdefault(r["temperature"], []).extend(r["rounds"])
    return {temp: round_breakdown(rows) for temp, rows in by_temp.items()}


def acceptance_by_category(runs: list[dict]) -> dict:
    """{(method, temperature): {category: accepted / drafted}} from the gateway's totals."""
    out: dict = {}
    for r in runs:
        if r["system"] == "tandem" and r["method"] != "none":
            key = (r["method"], r["temperature"])
            out.setdefault(key, {})[r["category"]] = _gateway_acceptance(
                runs, *key, r["category"])["acceptance_rate"]
    return out


def _target(name: str, goal: float, measured: float, note: str = "") -> dict:
    met = None if measured is None or math.isnan(measured) else measured >= goal
    return {"name": name, "goal": goal, "measured": measured, "met": met, "note": note}


def targets(table: dict, spec: dict, conc: list[dict]) -> list[dict]:
    def tps(system, method, key="all", temp=0.0):
        return table.get((system, method, temp), {}).get(key, math.nan)

    best = max(SPEC_METHODS, key=lambda m: _nan_low(ratio(tps("tandem", m),
                                                         tps("tandem", "none"))))
    eagle = spec.get(("eagle", 0.0)) or {}
    out = [
        _target(f"best method ({best}) >= 1.8x Tandem plain, greedy, 1 session", 1.8,
                ratio(tps("tandem", best), tps("tandem", "none"))),
        _target("eagle >= 2.2 committed tokens per round, greedy", 2.2,
                eagle.get("mean_accepted_length", math.nan)),
        _target("eagle greedy agreement at the first draft position >= 0.7", 0.7,
                (eagle.get("per_position") or [math.nan])[0]),
        _target("Tandem draft_model >= transformers assisted, greedy", 1.0,
                ratio(tps("tandem", "draft_model"), tps("transformers", "assisted"))),
        _target("Tandem ngram >= transformers prompt lookup, input-grounded, greedy", 1.0,
                ratio(tps("tandem", "ngram", "grounded"),
                      tps("transformers", "prompt_lookup", "grounded")))]
    for method in SPEC_METHODS:
        s = spec.get((method, 0.0))
        note = "" if not s or math.isnan(s["bound"]) else (
            f"S = {s['bound']:.2f}x at a = {s['alpha']:.2f}, k = {s['mean_k']:.1f}, "
            f"c = {s['c']:.3f}")
        out.append(_target(f"{method} speedup >= 85% of Leviathan's bound, greedy", 0.85,
                           s["of_bound"] if s else math.nan, note))
    return out + scaling_target(conc) + no_loss_target(conc)


def _method_order(method: str) -> tuple:
    known = (NONE, *SPEC_METHODS)  # as the other tables list them; others after, by name
    return (known.index(method), "") if method in known else (len(known), method)


def concurrency_table(rows: list[dict]) -> list[dict]:
    """The concurrency rows by level, then method (rows without one: draft_model), each with
    `vs_one` (its tokens/s over the same method's at 1 session) and `vs_none` (over none's at
    the same level)."""
    rows = [{**r, "method": r.get("method", OLD_CONCURRENCY_METHOD)} for r in rows]
    tps = {(r["sessions"], r["method"]): r["total_tps"] for r in rows}
    out = [{**r, "vs_one": ratio(r["total_tps"], tps.get((1, r["method"]), math.nan)),
            "vs_none": ratio(r["total_tps"], tps.get((r["sessions"], NONE), math.nan))}
           for r in rows]
    return sorted(out, key=lambda r: (r["sessions"], _method_order(r["method"])))


def scaling_target(conc: list[dict]) -> list[dict]:
    """16 sessions of none against one (results without none: their one method); the largest
    level run where 16 was not."""
    methods = {r["method"] for r in conc}
    method = NONE if NONE in methods else min(methods, key=_method_order, default=None)
    by_level = {r["sessions"]: r for r in conc if r["method"] == method}
    if len(by_level) < 2:
        return []
    n = SCALING_LEVEL if SCALING_LEVEL in by_level else max(by_level)
    notes = [] if n == SCALING_LEVEL else [f"{SCALING_LEVEL} not run (--quick): largest level"]
    notes += [] if method == NONE else [f"{NONE} not run: {method}"]
    return [_target(f"{n} concurrent sessions >= {SCALING_GOAL:g}x one session's total "
                    f"tokens/s, {method}", SCALING_GOAL, by_level[n]["vs_one"],
                    "; ".join(notes))]


def no_loss_target(conc: list[dict]) -> list[dict]:
    """At the largest level none ran: every other method's tokens/s over none's; the worst."""
    if not conc:
        return []
    name = (f"speculation never lowers throughput at the largest level: every method >= "
            f"{NO_LOSS_GOAL:g}x none's tokens/s")
    levels = [r["sessions"] for r in conc if r["method"] == NONE]
    spec = [r for r in conc if levels and r["sessions"] == max(levels) and r["method"] != NONE]
    if not spec:
        return [_target(name, NO_LOSS_GOAL, math.nan, f"{NONE} and a speculation method "
                        "not both run at one level")]
    worst = min(spec, key=lambda r: _nan_low(r["vs_none"]))
    return [_target(name, NO_LOSS_GOAL, worst["vs_none"],
                    f"worst at {worst['sessions']} sessions: {worst['method']} "
                    f"({len(spec)} methods)")]


def shape_targets(shapes: list[dict], table: dict, skipped: dict[str, str]) -> list[dict]:
    """Issue 11: committed tokens per round of medusa's and eagle's trees (chain-vs-tree
    phase), and the best speedup over plain of any method, greedy, in either phase."""
    by = {(r["method"], r["shape"]): r for r in shapes}
    goal = f">= {TREE_TOKENS_GOAL:g} committed tokens per round"
    names = {"medusa": f"medusa {goal} (tree)", "eagle": f"eagle tree {goal}"}
    out = [_target(name, TREE_TOKENS_GOAL,
                   by.get((m, "tree"), {}).get("tokens_per_round", math.nan),
                   f"not run: {skipped[m]}" if m in skipped else "")
           for m, name in names.items()]
    plain = table.get(("tandem", NONE, 0.0), {}).get("all", math.nan)
    best = {f"{m} (single-session phase)": ratio(table.get(("tandem", m, 0.0), {})
                                                 .get("all", math.nan), plain)
            for m in SPEC_METHODS}
    best |= {f"{r['method']} {r['shape']} (chain-vs-tree phase)": r["speedup"]
             for r in shapes if r["method"] != NONE}
    name = max(best, key=lambda n: _nan_low(best[n]), default="")
    measured = best.get(name, math.nan)
    return out + [_target(f"best method >= {BEST_GOAL:.1f}x plain through the gateway, greedy",
                          BEST_GOAL, measured, "" if math.isnan(measured) else name)]


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


def summarize(result: dict) -> dict:
    table = throughput_table(result["runs"])
    spec = speculation_table(result, table)
    conc = concurrency_table(result.get("concurrency", []))
    shapes = shapes_table(result.get("shapes", []), cost_curve(result["meta"]))
    return {"throughput": table, "speedup": speedups(table), "speculation": spec,
            "acceptance_by_category": acceptance_by_category(result["runs"]),
            "plain_rounds": plain_rounds(result), "concurrency": conc, "shapes": shapes,
            "targets": targets(table, spec, conc) + shape_targets(
                shapes, table, result["meta"].get("shapes_skipped") or {})}
