"""The chain-vs-tree phase of `tandem bench` (issue 11): eagle and medusa through the gateway
with `speculation.draft_shape` "chain" and then "tree", greedy, interleaved per prompt with
plain decoding, and what each shape commits per round against what its rounds cost.

Everything but run_shapes is pure Python, like stats.py, so a saved results.json re-renders
without a model.
"""
from __future__ import annotations

import math

from tandem.spec.methods import Method
from tools.bench.mdtable import fmt, table
from tools.bench.stats import ratio, throughput

NONE = Method.NONE.api_name
SHAPES = ("chain", "tree")
# the methods whose proposals are trees of their own (auto's are Medusa's)
TREE_METHODS = tuple(m.api_name for m in Method if m.can_tree and m is not Method.AUTO)
PLOT = "bench-chain-vs-tree.png"


def available(methods: tuple[str, ...], eagle: str,
              medusa_found: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """The methods of `methods` this run can serve, and why each other one is skipped (a row
    of plain decoding under another name would say nothing about shapes)."""
    skipped = {}
    if "eagle" in methods and not eagle:
        skipped["eagle"] = "no EAGLE head in this run (--eagle none, or none shipped)"
    if "medusa" in methods and not medusa_found:
        skipped["medusa"] = "no Medusa heads for this target"
    return tuple(m for m in methods if m not in skipped), skipped


def configs(methods: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(method, shape) in the order every prompt runs them: plain first, then each method's
    chain and tree back to back, so host drift hits both shapes alike."""
    return [(NONE, None)] + [(m, s) for m in methods for s in SHAPES]


def run_shapes(ctx, url: str, methods: tuple[str, ...]) -> None:
    """The phase: greedy requests through the gateway, one per (prompt, config). A failed
    request is recorded and the rest still run."""
    from tools.bench.client import chat_body, run_single

    cfg, order = ctx.cfg, configs(methods)
    prompts = ctx.prompts[:cfg.shape_prompts] if cfg.shape_prompts else ctx.prompts
    for method, shape in order:  # warm-up: a shape's first rounds pay one-off costs
        run_single(url, chat_body(prompts[0]["prompt"], 8, 0.0, method, cfg.k, shape=shape))
    for p in prompts:
        for method, shape in order:
            name = f"{method} {shape}" if shape else method
            ctx.bar.set_description(f"tandem {name} (chain vs tree) {p['id']}")
            body = chat_body(p["prompt"], cfg.max_tokens, 0.0, method, cfg.k, shape=shape)
            try:
                out = run_single(url, body)
            except Exception as exc:  # reported in the results and on screen
                ctx.result["meta"].setdefault("errors", []).append(
                    f"shapes {name} {p['id']}: {exc!r}")
            else:
                ctx.result["shapes"].append(
                    {"system": "tandem", "method": method, "shape": shape, "temperature": 0.0,
                     "prompt_id": p["id"], "category": p["category"],
                     "grounded": p["grounded"], **out})
            ctx.bar.update()


def jobs(cfg, n_prompts: int, methods: tuple[str, ...]) -> int:
    """Progress-bar units of the phase (one per measured request)."""
    if not methods:
        return 0
    n = min(n_prompts, cfg.shape_prompts) if cfg.shape_prompts else n_prompts
    return n * len(configs(methods))


# ---- summary ------------------------------------------------------------------------------


def cost_curve(meta: dict) -> dict[int, float]:
    """The run's verify-cost curve {tokens per forward: ms} (JSON made its keys strings)."""
    ms = (meta.get("cost_verify") or {}).get("ms") or {}
    return {int(q): float(v) for q, v in ms.items()}


def relative_cost(curve: dict[int, float], q: float) -> float:
    """cost(q) / cost(1): linear between measured points (q may be a mean), growing in
    proportion to q past the last one (as tandem.spec.cost.CostModel does); NaN without a
    measured cost(1)."""
    if not curve.get(1):
        return math.nan
    pts = sorted(curve.items())
    if q <= pts[0][0]:
        return pts[0][1] / curve[1]
    for (q0, c0), (q1, c1) in zip(pts, pts[1:]):
        if q <= q1:
            return (c0 + (c1 - c0) * (q - q0) / (q1 - q0)) / curve[1]
    q_last, c_last = pts[-1]
    return c_last * q / q_last / curve[1]


def shape_bound(tokens_per_round: float, mean_verified: float, curve: dict[int, float]) -> float:
    """(tokens per round) x cost(1) / cost(mean verified + 1): the speedup over plain decoding
    if a round cost only its verify forward (the drafting wait left out)."""
    if math.isnan(mean_verified):
        return math.nan
    return ratio(tokens_per_round, relative_cost(curve, mean_verified + 1))


def _stats(method: str, shape: str | None, rows: list[dict], plain_tps: float,
           curve: dict[int, float]) -> dict:
    spec = [r.get("speculation") or {} for r in rows]
    rounds = sum(x.get("rounds", 0) for x in spec)
    drafted = sum(x.get("drafted_tokens", 0) for x in spec)
    accepted = sum(x.get("accepted_tokens", 0) for x in spec)
    tokens = sum(r["tokens"] for r in rows)
    tpr = tokens / rounds if rounds else math.nan  # committed tokens per round
    verified = drafted / rounds if rounds else math.nan  # nodes (or chain drafts) per round
    tps = throughput(rows)
    return {"method": method, "shape": shape, "requests": len(rows), "tokens": tokens,
            "rounds": rounds, "drafted": drafted, "accepted": accepted,
            "tokens_per_round": tpr, "acceptance": ratio(accepted, drafted),
            "mean_verified": verified, "tps": tps, "speedup": ratio(tps, plain_tps),
            "bound": shape_bound(tpr, verified, curve)}


def _order(row: dict) -> tuple:
    known = (NONE, *TREE_METHODS)
    m = row["method"]
    return (known.index(m) if m in known else len(known), m,
            SHAPES.index(row["shape"]) if row["shape"] in SHAPES else -1)


def shapes_table(rows: list[dict], curve: dict[int, float]) -> list[dict]:
    """One row per (method, shape) of the phase, plain first; speedups over plain's tokens/s
    in the same phase."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r.get("shape")), []).append(r)
    plain = throughput(groups.get((NONE, None), []))
    return sorted((_stats(m, s, rs, plain, curve) for (m, s), rs in groups.items()), key=_order)


# ---- report -------------------------------------------------------------------------------


def shapes_md(rows: list[dict]) -> str:
    out = [[r["method"] if r["method"] != NONE else "plain (none)", r["shape"] or "–",
            str(r["requests"]), fmt(r["tokens_per_round"], ".2f"), fmt(r["acceptance"], ".2f"),
            fmt(r["mean_verified"], ".2f"), fmt(r["tps"]), fmt(r["speedup"], ".2f", "x"),
            fmt(r["bound"], ".2f", "x")] for r in rows]
    return table(["method", "shape", "requests", "tokens / round", "accepted / drafted",
                  "nodes verified / round", "tokens/s", "vs plain", "bound"], out,
                 text_cols=(0, 1))


def _curve_line(curve: dict[int, float]) -> str:
    if not curve:
        return "No verify-cost curve was measured in this run: the bound column is empty."
    rel = ", ".join(f"{q}: {relative_cost(curve, q):.2f}" for q in sorted(curve))
    return (f"Verify cost by tokens per forward, relative to one ({fmt(curve.get(1), '.1f')} "
            f"ms), measured in the benchmark process before the cluster starts: {rel}.")


def shapes_section(result: dict, s: dict, img_prefix: str) -> list[str]:
    """The report's "Chain vs tree" section, as lines."""
    skipped = result["meta"].get("shapes_skipped") or {}
    lines = ["## Chain vs tree (greedy, through the gateway)", ""]
    lines += [f"> {m} not run: {why}\n" for m, why in skipped.items()]
    if not any(r["shape"] for r in s.get("shapes") or []):
        return lines + ["Not run (`--shape-methods`; results from before this phase have "
                        "none).", ""]
    return lines + [
        "Each prompt runs plain decoding, then each method with `speculation.draft_shape` "
        "chain and tree, one after the other (T = 0, one session). The verifier's cost model "
        "still sizes every round, so a shape may verify few or no nodes where they do not pay.",
        "", shapes_md(s["shapes"]), "", f"![chain vs tree]({img_prefix}{PLOT})", "",
        "*Tokens / round* = tokens generated / rounds (the gateway's `speculation` totals); "
        "*nodes verified / round* = drafted / rounds (rounds that verified none count as 0); "
        "*vs plain* = tokens/s over plain decoding in this phase. *Bound* = (tokens / round) "
        "x cost(1) / cost(nodes verified / round + 1), cost(q) being the target's forward over "
        "q tokens from the curve below (linear between measured points): the speedup if a "
        "round cost only its verify forward. It leaves out the drafting wait (an EAGLE tree is "
        "drafted after each commit) and the gateway hop, so the measured speedup stays below "
        "it.", "", _curve_line(cost_curve(result["meta"])), ""]
