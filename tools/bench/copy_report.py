"""The copy-heavy workload's arithmetic and page (tools/bench/copy_heavy.py runs it): copy
share, speedups against plain on the same prompts, Leviathan's bound with the measured verify
cost, the Markdown table with its aggregate rows, and docs/results/benchmarks-copy.md with its
plot."""
from __future__ import annotations

import json
from pathlib import Path

from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS
from tools.bench.copy_prompts import CATEGORIES, CHAT, PROMPTS

ARMS = ("none", "ngram", "suffix", "medusa", "eagle", "draft_model", "auto", "layer_skip")
OPT_IN_ARMS = ("layer_skip",)  # asked only when named in --arms (it rarely pays on a CPU)
WORKER_ARMS = ("none", "ngram", "suffix")  # where the draft worker does the token-history drafts
REPEAT_ARMS = ("none", "suffix", "auto")  # asked again: their caches hold the first answer


def copy_share(answer: str, prompt: str, span: int = 12) -> float:
    spans = [answer[i:i + span] for i in range(0, max(0, len(answer) - span + 1))]
    return sum(s in prompt for s in spans) / len(spans) if spans else 0.0


def _tps(rows: list[dict]) -> float:
    return sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows)


def summarise(rows: list[dict]) -> dict:
    """Per arm overall and per prompt: tokens/s over plain's on the same requests."""
    if not rows:
        return {}
    out = {"per_prompt": {}, "overall": {}}
    plain_all = [r for r in rows if r["arm"] == "none"]
    plain_text = {r["prompt"]: r["text"] for r in plain_all}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        sel = [r for r in rows if r["arm"] == arm]
        drafted = sum(r["spec"].get("drafted_tokens", 0) for r in sel)
        accepted = sum(r["spec"].get("accepted_tokens", 0) for r in sel)
        out["overall"][arm] = {
            "tps": _tps(sel), "speedup": _tps(sel) / _tps(plain_all),
            "acceptance": accepted / drafted if drafted else None,
            "identical_to_plain": all(r["text"] == plain_text[r["prompt"]] for r in sel)}
    for i in sorted({r["prompt"] for r in rows}):
        plain = [r for r in plain_all if r["prompt"] == i]
        row = {"copy_share": copy_share(plain[0]["text"], PROMPTS[i])}
        for arm in out["overall"]:
            if arm != "none":
                row[arm] = _tps([r for r in rows if r["prompt"] == i and r["arm"] == arm]) / \
                    _tps(plain)
        out["per_prompt"][str(i)] = row
    return out


def _curve(curve: dict) -> tuple[list[int], list[float]]:
    ms = {int(q): float(v) for q, v in curve.items()}  # JSON keys are strings
    return sorted(ms), [ms[q] for q in sorted(ms)]


def bound(alpha: float, curve: dict[int, float],
          max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS) -> tuple[float, int]:
    """Leviathan's bound: the best speedup any fixed k reaches at i.i.d. acceptance alpha,
    max_k E(alpha, k) / (cost(k + 1) / cost(1)), with the round's cost from the measured
    curve; and that k."""
    import numpy as np

    qs, ms = _curve(curve)
    a = min(alpha, 1 - 1e-9)
    best = max(range(max_spec_tokens + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) /
               float(np.interp(k + 1, qs, ms)))
    return (1 - a ** (best + 1)) / (1 - a) / (float(np.interp(best + 1, qs, ms)) / ms[0]), best


def ceiling(tokens: int, rounds: int, drafted: int, curve: dict[int, float]) -> float:
    """The speedup of the rounds that really ran if nothing but the target's forwards took
    time: tokens x cost(1) over the sum of the rounds' costs. The curve is close to affine
    (cost(q) = c0 + c1 q), so the sum needs only rounds and drafted tokens: every round
    verifies its drafts and one more token."""
    import numpy as np

    qs, ms = _curve(curve)
    c1, c0 = np.polyfit(qs, ms, 1)
    return tokens * (c0 + c1) / (rounds * c0 + c1 * (rounds + drafted))


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _arms(result: dict) -> list[str]:
    return [a for a in ARMS[1:] if any(a in s["overall"] for s in result["places"].values())]


def _vs_best(row: dict) -> float | None:
    """auto's speedup over the best single method's in the same row."""
    singles = [v for a, v in row.items() if a not in ("none", "auto") and v is not None]
    return row["auto"] / max(singles) if row.get("auto") and singles else None


def markdown(result: dict) -> str:
    """First asks per prompt for every arm, auto against the best single method, the repeats
    apart, then the aggregates, the bound table and the verdict on auto."""
    arms = _arms(result)
    lines = ["| drafts made in | prompt | copy share | " + " | ".join(arms) +
             " | auto / best single | suffix, repeats | auto, repeats |",
             "|---|---|---:|" + "---:|" * (len(arms) + 3)]
    for place, s in result["places"].items():
        first, repeat = s["first"]["per_prompt"], s["repeat"].get("per_prompt", {})
        for i, row in first.items():
            lines.append(f"| {place} | {i} ({CATEGORIES[int(i)]}): {PROMPTS[int(i)][:36]!r}... | "
                         f"{row['copy_share']:.2f} | " +
                         " | ".join(_x(row.get(a)) for a in arms) +
                         f" | {_x(_vs_best(row))} | {_x(repeat.get(i, {}).get('suffix'))} | "
                         f"{_x(repeat.get(i, {}).get('auto'))} |")
        for label, agg, share, n in _aggregates(s):
            row = {a: agg["overall"].get(a, {}).get("speedup") for a in arms}
            lines.append(f"| {place} | **{label}** ({n} prompts) | {share:.2f} | " +
                         " | ".join(f"**{_x(row[a])}**" for a in arms) +
                         f" | **{_x(_vs_best(row))}** | | |")
    if result.get("verify_ms"):
        lines += ["", *bound_table(result)]
    same = all(a["identical_to_plain"] for s in result["places"].values()
               for a in s["overall"].values())
    acc = {p: {a: v["acceptance"] for a, v in s["overall"].items() if a != "none"}
           for p, s in result["places"].items()}
    lines += ["", f"Text identical to plain for every arm and prompt: {same}. Plain tokens/s: " +
              ", ".join(f"{p} {s['overall']['none']['tps']:.1f}"
                        for p, s in result["places"].items()) +
              f". Acceptance (all asks): {json.dumps(acc, default=lambda v: round(v, 2))}",
              "", auto_verdict(result)]
    return "\n".join(lines)


def _aggregates(s: dict) -> list[tuple[str, dict, float, int]]:
    """(label, summary of its first asks, mean copy share, prompts) per aggregate row."""
    first, out = s["first"]["per_prompt"], []
    for label, picks in _groups(first):
        agg = summarise([r for r in s["rows"] if r["rep"] == 0 and r["prompt"] in picks])
        if agg:
            share = sum(first[str(i)]["copy_share"] for i in picks) / len(picks)
            out.append((label, agg, share, len(picks)))
    return out


def auto_verdict(result: dict) -> str:
    """Whether auto, in the verifier's cluster, is within 0.97x of the best single method and
    not below plain in every category (the per-category aggregate rows)."""
    s = result["places"].get("verifier")
    if not s or "auto" not in s["overall"]:
        return "auto not measured."
    worst, ok = [], True
    for label, agg, _, _ in _aggregates(s):
        if label in ("copy share >= 0.7", "all copy tasks"):
            continue
        row = {a: v["speedup"] for a, v in agg["overall"].items()}
        ratio = _vs_best(row)
        ok &= ratio is not None and ratio >= 0.97 and row["auto"] >= 1.0
        worst.append((ratio or 0.0, label, row["auto"]))
    ratio, label, got = min(worst)
    return (f"auto within 0.97x of the best single method and not below plain in every "
            f"category: {ok} (its lowest: {label}, {got:.2f}x plain, {ratio:.2f}x the best).")


def _groups(first: dict) -> list[tuple[str, list[int]]]:
    """The aggregate rows: copy-rich answers, all copy tasks, then each category."""
    rich = [int(i) for i, row in first.items() if row["copy_share"] >= 0.7]
    groups = [("copy share >= 0.7", rich),
              ("all copy tasks", [int(i) for i in first if PROMPTS[int(i)] not in CHAT])]
    for category in dict.fromkeys(CATEGORIES):
        groups.append((category, [int(i) for i in first if CATEGORIES[int(i)] == category]))
    return [(label, picks) for label, picks in groups if picks]


def bound_table(result: dict) -> list[str]:
    """How much of Leviathan's bound and of the ceiling of the rounds run each arm realises
    on the copy-rich first asks, with the acceptance and drafts per round it measured."""
    lines = ["Bounds on the copy share >= 0.7 first asks, from the verify cost measured at the "
             "start of the run (ms by new tokens: " +
             ", ".join(f"{q}: {float(v):.0f}" for q, v in result["verify_ms"].items()) + "). "
             "**Leviathan's bound**: the best speedup a fixed k reaches at the measured "
             "acceptance a if every draft were accepted with probability a independently, "
             "max_k E(a, k) / (cost(k + 1) / cost(1)). Rounds sized by the proposal's "
             "confidence beat it (above 100%): acceptance is not independent of the proposal, "
             "and long drafts go where it is high. **Ceiling**: the speedup of the rounds that "
             "really ran if the target's forwards were all that took time (tokens x cost(1) "
             "over the sum of the rounds' costs, an affine fit of the curve); what is missing "
             "from it is overhead (prefill, HTTP, drafting, sampling, the scheduler).",
             "", "| drafts made in | method | a | k per round | Leviathan's bound (k) | "
             "ceiling | measured | of bound | of ceiling |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for place, s in result["places"].items():
        rich = [int(i) for i, row in s["first"]["per_prompt"].items()
                if row["copy_share"] >= 0.7]
        rows = [r for r in s["rows"] if r["rep"] == 0 and r["prompt"] in rich]
        agg = summarise(rows)
        for arm in ARMS[1:]:
            sel = [r for r in rows if r["arm"] == arm]
            drafted = sum(r["spec"].get("drafted_tokens", 0) for r in sel)
            rounds = sum(r["spec"].get("rounds", 0) for r in sel)
            if not drafted or not rounds:
                continue
            a = sum(r["spec"].get("accepted_tokens", 0) for r in sel) / drafted
            b, k = bound(a, result["verify_ms"])
            top = ceiling(sum(r["tokens"] for r in sel), rounds, drafted, result["verify_ms"])
            got = agg["overall"][arm]["speedup"]
            lines.append(f"| {place} | {arm} | {a:.2f} | {drafted / rounds:.1f} | {b:.2f}x "
                         f"({k}) | {top:.2f}x | {got:.2f}x | {got / b:.0%} | {got / top:.0%} |")
    return lines


def write_docs(result: dict, table: str, docs: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["places"].get("verifier") or next(iter(result["places"].values()))
    rows = [(label, agg) for label, agg, _, _ in _aggregates(s) if label != "all copy tasks"]
    arms = [a for a in ARMS[1:] if a in s["overall"]]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.8 / len(arms)
    for b, arm in enumerate(arms):
        ax.bar([i + b * width - 0.4 + width / 2 for i in range(len(rows))],
               [agg["overall"].get(arm, {}).get("speedup", 0.0) for _, agg in rows], width,
               label=arm)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(2.5, color="red", lw=0.8, ls="--", label="target 2.5x (copy share >= 0.7)")
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=8, rotation=20,
                  ha="right")
    ax.set_ylabel("tokens/s vs plain (same cluster)")
    ax.set_title("Copy-heavy work through the gateway, first asks, by category")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    model = result.get("model", "default")
    name = "benchmarks-copy" + ("" if model == "default" else f"-{Path(model).name}")
    (docs / "img").mkdir(parents=True, exist_ok=True)
    fig.savefig(docs / "img" / f"{name}.png", dpi=110, bbox_inches="tight")
    t = result["temperature"]
    (docs / f"{name}.md").write_text("\n".join([
        "# Copy-heavy prompts: drafts that cost nothing on the critical path"
        + ("" if model == "default" else f" ({model})"), "",
        f"Generated by `tandem bench --workload copy` (tools/bench/copy_heavy.py) on "
        f"{result['date']}; "
        f"{len(PROMPTS)} prompts; each first asked {result.get('first_reps', 1)} time(s) per "
        f"arm (every pass as fresh tenants), then asked again up to {result['reps']} asks in "
        "all, "
        f"{'greedy' if not t else f'T = {t}, seeded'}, up to {result['tokens']} new tokens "
        "(EOS stops), through the gateway of a fresh local cluster per row group (1 verifier, "
        "1 draft worker, 1 torch thread each; the verifier's --dtype auto: int8 where "
        "exact for the target, as for the default one, else float32). Rows: where ngram "
        "and suffix draft (`--history-drafts verifier`, the "
        "default, or `worker`). Speedup = the arm's tokens/s over plain's on the same prompts "
        "in the same cluster, arms rotated per prompt; each arm is its own tenant (API key), so "
        "its suffix cache holds only its own answers. The method columns are first asks; "
        "`suffix, repeats` and `auto, repeats` the second ask of the same prompt. Copy share = the "
        "fraction of the plain answer's 12-character spans found in the prompt (in an "
        "aggregate row, the mean over its prompts). One ask per "
        "prompt and arm is noisy (a few seconds each on a shared host): read the aggregate rows.",
        "",
        table, "", f"![speedup per category and method](img/{name}.png)", ""]))
