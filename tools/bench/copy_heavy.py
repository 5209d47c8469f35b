"""Copy-heavy prompts through the gateway: plain decoding against ngram, suffix and auto.

  tandem bench --workload copy [--repeats 2] [--max-tokens 256] [--docs docs]
  python benchmarks/copy_heavy.py [--tokens 256] [--reps 2] [--history verifier,worker]
                                  [--temperature 0] [--out results/copy_heavy.json]
                                  [--docs docs]  # writes docs/benchmarks-copy.md + a plot

One local cluster per `--history` place (the verifier's --history-drafts: ngram and suffix
drafted in the verifier's own step, or by the draft worker over the draft link). In each, every
prompt is asked once per arm per rep (none, ngram, suffix; and auto where the verifier drafts),
by category, and two chat prompts beside them, the arms' order rotating prompt by
prompt so drift hits all alike; greedy (or seeded sampling: the same text whatever the
method), non-streaming. Each arm is its own tenant (an API key each), so suffix caches are
the arm's own. Rep 0 is every prompt's first ask (the arm's cache holds only other prompts'
answers); later reps are repeats, where suffix and auto also draft from their own earlier
answer. Speed is completion tokens over the request's
wall time; speedup is each arm's total tokens/s over plain's in the same cluster. Copy
share: the fraction of the plain answer's 12-character spans that occur in the prompt.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import httpx

from tools.bench.copy_prompts import CATEGORIES, CHAT, PROMPTS
from tools.launcher import Cluster, ClusterConfig, free_port

ARMS = ("none", "ngram", "suffix", "auto")


def copy_share(answer: str, prompt: str, span: int = 12) -> float:
    spans = [answer[i:i + span] for i in range(0, max(0, len(answer) - span + 1))]
    return sum(s in prompt for s in spans) / len(spans) if spans else 0.0


def key_of(arm: str) -> str:
    """Each arm asks with its own API key, so it is its own tenant: the verifier's suffix
    caches are per tenant, and no arm drafts from another arm's answer to the same prompt."""
    return f"bench-{arm}"


def ask(url: str, prompt: str, method: str, tokens: int, temperature: float = 0.0) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": tokens, "temperature": temperature,
            "seed": 7, "messages": [{"role": "user", "content": prompt}],
            "speculation": {"method": method}}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {key_of(method)}"})
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return {"text": out["choices"][0]["message"]["content"], "wall_s": wall,
            "tokens": out["usage"]["completion_tokens"], "spec": out.get("speculation") or {}}


def run_place(place: str, reps: int, tokens: int, temperature: float) -> dict:
    # auto drafts in the verifier only: on a worker-drafting cluster it would measure nothing
    arms = ARMS if place == "verifier" else ARMS[:3]
    cluster = Cluster(ClusterConfig(gateway_port=free_port()), log=print,
                      env={"TANDEM_VERIFIER_HISTORY_DRAFTS": place,
                           "TANDEM_API_KEYS": ",".join(key_of(a) for a in ARMS)},
                      output=subprocess.DEVNULL)
    cluster.start()
    rows = []
    try:
        ask(cluster.gateway_url, "Say hi.", "none", 8)  # warm up
        for rep in range(reps):
            for i, prompt in enumerate(PROMPTS):
                k = (i + rep) % len(arms)
                for arm in arms[k:] + arms[:k]:
                    res = ask(cluster.gateway_url, prompt, arm, tokens, temperature)
                    rows.append({"rep": rep, "prompt": i, "arm": arm, **res})
                    print(f"[{place}] rep {rep} prompt {i} {arm}: {res['tokens']} tokens "
                          f"{res['tokens'] / res['wall_s']:.1f} tok/s "
                          f"accepted {res['spec'].get('acceptance_rate')}", flush=True)
    finally:
        cluster.stop()
    return {"rows": rows, "first": summarise([r for r in rows if r["rep"] == 0]),
            "repeat": summarise([r for r in rows if r["rep"] > 0]), **summarise(rows)}


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


def verify_curve(counts=(1, 2, 3, 4, 6, 8, 12, 16, 17)) -> dict[int, float]:
    """ms of one target forward over q new tokens, as the cluster's verifier runs it (the
    target under --dtype auto, 1 torch thread): the cost side of Leviathan's bound."""
    import torch

    from tandem.device import place
    from tandem.engine.exact_dtype import load_target
    from tandem.engine.model_runner import ModelRunner
    from tandem.models import resolve_model
    from verify_service.calibration import calibrate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_target(resolve_model("default"), place("cpu", "auto"))
        return calibrate(ModelRunner.with_memory(model, 64 << 20, 16), counts, reps=5)
    finally:
        torch.set_num_threads(threads)


def bound(alpha: float, k: float, curve: dict[int, float]) -> float:
    """Leviathan's speedup for acceptance alpha and k drafts per round (a mean: fractional),
    with the round's cost from the measured curve: E(alpha, k) / (cost(k + 1) / cost(1))."""
    import numpy as np

    ms = {int(q): float(v) for q, v in curve.items()}  # JSON keys are strings
    cost = float(np.interp(k + 1, sorted(ms), [ms[q] for q in sorted(ms)]))
    a = min(alpha, 1 - 1e-9)
    return (1 - a ** (k + 1)) / (1 - a) / (cost / ms[1])


def run_workload(tokens: int = 256, reps: int = 2, places=("verifier", "worker"),
                 temperature: float = 0.0, out: Path = Path("results/copy_heavy.json"),
                 docs: Path | None = None) -> dict:
    """One cluster per place, every prompt and arm; table printed, JSON (and docs) written."""
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": tokens, "reps": reps,
              "temperature": temperature, "verify_ms": verify_curve(), "places": {}}
    for place in places:
        result["places"][place] = run_place(place, reps, tokens, temperature)
    table = markdown(result)
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if docs is not None:
        write_docs(result, table, docs)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="max new tokens per request")
    ap.add_argument("--reps", type=int, default=2, help="asks per prompt and arm")
    ap.add_argument("--history", default="verifier,worker",
                    help="where ngram/suffix draft, one cluster each (verifier, worker)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else seeded")
    ap.add_argument("--out", default="results/copy_heavy.json")
    ap.add_argument("--docs", default="", help="also write DOCS/benchmarks-copy.md and a plot")
    args = ap.parse_args(argv)
    run_workload(args.tokens, args.reps, tuple(args.history.split(",")), args.temperature,
                 Path(args.out), Path(args.docs) if args.docs else None)


def rerender(path: str, docs: str) -> None:
    """The table, page and plot again from a saved run (`--report`)."""
    result = json.loads(Path(path).read_text())
    write_docs(result, markdown(result), Path(docs))


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


if __name__ == "__main__":
    main()
