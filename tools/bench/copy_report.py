"""The copy-heavy workload's arithmetic and page (tools/bench/copy_heavy.py runs it): copy
share, speedups against plain on the same prompts, Leviathan's bound with the measured verify
cost, the Markdown table with its aggregate rows, and docs/benchmarks-copy.md with its plot."""
from __future__ import annotations

import json
from pathlib import Path

from tools.bench.copy_prompts import CATEGORIES, CHAT, PROMPTS

ARMS = ("none", "ngram", "suffix", "auto")


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


def bound(alpha: float, k: float, curve: dict[int, float]) -> float:
    """Leviathan's speedup for acceptance alpha and k drafts per round (a mean: fractional),
    with the round's cost from the measured curve: E(alpha, k) / (cost(k + 1) / cost(1))."""
    import numpy as np

    ms = {int(q): float(v) for q, v in curve.items()}  # JSON keys are strings
    cost = float(np.interp(k + 1, sorted(ms), [ms[q] for q in sorted(ms)]))
    a = min(alpha, 1 - 1e-9)
    return (1 - a ** (k + 1)) / (1 - a) / (cost / ms[1])


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}x"


def markdown(result: dict) -> str:
    """First asks per prompt for every arm, suffix's repeats apart, then the aggregates."""
    arms = [a for a in ARMS[1:] if any(a in s["overall"] for s in result["places"].values())]
    lines = ["| drafts made in | prompt | copy share | " + " | ".join(arms) +
             " | suffix, repeats |", "|---|---|---:|" + "---:|" * (len(arms) + 1)]
    for place, s in result["places"].items():
        first, repeat = s["first"]["per_prompt"], s["repeat"].get("per_prompt", {})
        for i, row in first.items():
            lines.append(f"| {place} | {i} ({CATEGORIES[int(i)]}): {PROMPTS[int(i)][:36]!r}... | "
                         f"{row['copy_share']:.2f} | " +
                         " | ".join(_x(row.get(a)) for a in arms) +
                         f" | {_x(repeat.get(i, {}).get('suffix'))} |")
        for label, picks in _groups(first):
            agg = summarise([r for r in s["rows"] if r["rep"] == 0 and r["prompt"] in picks])
            share = sum(first[str(i)]["copy_share"] for i in picks) / max(1, len(picks))
            if agg:
                lines.append(f"| {place} | **{label}** ({len(picks)} prompts) | {share:.2f} | " +
                             " | ".join(
                    f"**{_x(agg['overall'].get(a, {}).get('speedup'))}**" for a in arms) + " | |")
    if result.get("verify_ms"):
        lines += ["", *bound_table(result)]
    same = all(a["identical_to_plain"] for s in result["places"].values()
               for a in s["overall"].values())
    acc = {p: {a: v["acceptance"] for a, v in s["overall"].items() if a != "none"}
           for p, s in result["places"].items()}
    lines += ["", f"Text identical to plain for every arm and prompt: {same}. Plain tokens/s: " +
              ", ".join(f"{p} {s['overall']['none']['tps']:.1f}"
                        for p, s in result["places"].items()) +
              f". Acceptance (all asks): {json.dumps(acc, default=lambda v: round(v, 2))}"]
    return "\n".join(lines)


def _groups(first: dict) -> list[tuple[str, list[int]]]:
    """The aggregate rows: copy-rich answers, all copy tasks, then each category."""
    rich = [int(i) for i, row in first.items() if row["copy_share"] >= 0.7]
    groups = [("copy share >= 0.7", rich),
              ("all copy tasks", [int(i) for i in first if PROMPTS[int(i)] not in CHAT])]
    for category in dict.fromkeys(CATEGORIES):
        groups.append((category, [int(i) for i in first if CATEGORIES[int(i)] == category]))
    return [(label, picks) for label, picks in groups if picks]


def bound_table(result: dict) -> list[str]:
    """How much of Leviathan's bound each arm realises on the copy-rich first asks, with the
    acceptance and mean drafts per round it measured and the measured verify-cost curve."""
    lines = ["Leviathan's bound on the copy share >= 0.7 first asks: E(a, k) / (cost(k + 1) / "
             "cost(1)) with a = accepted / drafted, k = drafts per round (a mean over all rounds, "
             "those without a match included, so the bound is approximate: a mix of long and "
             "empty rounds does better than their mean) and the verify cost measured at the "
             "start of the run (ms by new tokens: " +
             ", ".join(f"{q}: {float(v):.0f}" for q, v in result["verify_ms"].items()) + ").",
             "", "| drafts made in | method | a | k per round | bound | measured | of bound |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for place, s in result["places"].items():
        rich = [int(i) for i, row in s["first"]["per_prompt"].items()
                if row["copy_share"] >= 0.7]
        rows = [r for r in s["rows"] if r["rep"] == 0 and r["prompt"] in rich]
        agg = summarise(rows)
        for arm in ARMS[1:]:
            sel = [r["spec"] for r in rows if r["arm"] == arm]
            drafted = sum(x.get("drafted_tokens", 0) for x in sel)
            rounds = sum(x.get("rounds", 0) for x in sel)
            if not drafted or not rounds:
                continue
            a = sum(x.get("accepted_tokens", 0) for x in sel) / drafted
            b = bound(a, drafted / rounds, result["verify_ms"])
            got = agg["overall"][arm]["speedup"]
            lines.append(f"| {place} | {arm} | {a:.2f} | {drafted / rounds:.1f} | {b:.2f}x | "
                         f"{got:.2f}x | {got / b:.0%} |")
    return lines


def write_docs(result: dict, table: str, docs: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    bars = [(place, arm) for place, s in result["places"].items() for arm in ARMS[1:]
            if arm in s["overall"]]
    width = 0.8 / len(bars)
    for b, (place, arm) in enumerate(bars):
        rows = result["places"][place]["first"]["per_prompt"]
        ax.bar([int(i) + b * width - 0.4 + width / 2 for i in rows],
               [r[arm] for r in rows.values()], width, label=f"{arm}, drafted in the {place}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(2.5, color="red", lw=0.8, ls="--", label="target 2.5x")
    ax.set_xticks(range(len(PROMPTS)), [f"{i} {c}" for i, c in enumerate(CATEGORIES)],
                  fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("tokens/s vs plain (same cluster)")
    ax.set_title("Copy-heavy prompts through the gateway, first asks")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    (docs / "img").mkdir(parents=True, exist_ok=True)
    fig.savefig(docs / "img" / "benchmarks-copy.png", dpi=110, bbox_inches="tight")
    t = result["temperature"]
    (docs / "benchmarks-copy.md").write_text("\n".join([
        "# Copy-heavy prompts: drafts that cost nothing on the critical path", "",
        f"Generated by `tandem bench --workload copy` (tools/bench/copy_heavy.py) on "
        f"{result['date']}; "
        f"{len(PROMPTS)} prompts x {result['reps']} asks per arm, "
        f"{'greedy' if not t else f'T = {t}, seeded'}, up to {result['tokens']} new tokens "
        "(EOS stops), through the gateway of a fresh local cluster per row group (1 verifier, "
        "1 draft worker, 1 torch thread each; the verifier's --dtype auto: int8, exact for "
        "this target). Rows: where ngram and suffix draft (`--history-drafts verifier`, the "
        "default, or `worker`). Speedup = the arm's tokens/s over plain's on the same prompts "
        "in the same cluster, arms rotated per prompt; each arm is its own tenant (API key), so "
        "its suffix cache holds only its own answers. The ngram / suffix / auto columns are "
        "first asks; `suffix, repeats` the second ask of the same prompt. Copy share = the "
        "fraction of the plain answer's 12-character spans found in the prompt (in an "
        "aggregate row, the mean over its prompts). One ask per "
        "prompt and arm is noisy (a few seconds each on a shared host): read the aggregate rows.",
        "",
        table, "", "![speedup per prompt](img/benchmarks-copy.png)", ""]))
