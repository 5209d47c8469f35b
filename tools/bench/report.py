"""The run as people read it: results.json, a Markdown report and its PNG plots in
results/bench-<date>/, and the same report as docs/results/benchmarks.md (plots in img/)."""
from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

from tools.bench import shapes
from tools.bench.mdtable import fmt, table
from tools.bench.summary import LABELS, summarize

PLOTS = {"speedup": "bench-speedup.png", "concurrency": "bench-concurrency.png",
         "acceptance": "bench-acceptance-by-position.png",
         "breakdown": "bench-round-breakdown.png", "shapes": shapes.PLOT}
BREAKDOWN_PARTS = (("draft_wait_ms", "waiting for drafts"), ("verify_ms", "verify forward"),
                   ("rejection_ms", "rejection sampling"),
                   ("other_ms", "network + serialization + scheduling"))


def _categories(s: dict) -> list[str]:
    cats = []
    for row in s["throughput"].values():
        cats += [c for c in row["by_category"] if c not in cats]
    return cats


def throughput_md(s: dict) -> str:
    cats = _categories(s)
    rows = []
    for temp in sorted({k[2] for k in s["throughput"]}):
        for (system, method), label in LABELS.items():
            row = s["throughput"].get((system, method, temp))
            if row is None:
                continue
            sp = s["speedup"].get((system, method, temp), {})
            rows.append([f"{label}, T={temp:g}"] +
                        [fmt(row["by_category"].get(c)) for c in cats] +
                        [f"**{fmt(row['all'])}**", fmt(row["grounded"]),
                         fmt(sp.get("all"), ".2f", "x"), fmt(row["ttft_s"] * 1e3, ".0f")])
    return table(["method", *cats, "all", "input-grounded", "vs Tandem plain", "TTFT ms"], rows)


def speculation_md(s: dict) -> str:
    rows = []
    for (method, temp), v in sorted(s["speculation"].items(), key=lambda kv: kv[0][1]):
        reached = list(v["per_position"])
        while reached and math.isnan(reached[-1]):  # positions no round verified
            reached.pop()
        pos = ", ".join(fmt(x, ".2f") for x in reached) or "–"
        rows.append([f"{method}, T={temp:g}", fmt(v["acceptance_rate"], ".2f"),
                     fmt(v["spec_share"] * 100, ".0f", "%"),
                     fmt(v["alpha"], ".2f") + ("" if v["alpha_source"] == "rounds" else "*"),
                     pos, fmt(v["mean_accepted_length"], ".2f"),
                     fmt(v["mean_k"], ".1f") + ("" if v["alpha_source"] == "rounds" else "*"),
                     fmt(v["c"], ".3f"), fmt(v["bound"], ".2f", "x"),
                     f"{fmt(v['best_bound'], '.2f', 'x')} (k={v['best_k']})",
                     fmt(v["measured"], ".2f", "x"), fmt(v["of_bound"] * 100, ".0f", "%")])
    return table(["method", "accepted / drafted", "rounds with drafts", "a",
                  "per-position acceptance 1..k",
                  "tokens / round", "mean k", "c", "Leviathan S", "best S", "measured",
                  "of S"], rows)


def acceptance_md(s: dict) -> str:
    cats = _categories(s)
    rows = [[f"{m}, T={t:g}"] + [fmt(v.get(c), ".2f") for c in cats]
            for (m, t), v in sorted(s["acceptance_by_category"].items(), key=lambda kv: kv[0][1])]
    return table(["accepted / drafted", *cats], rows)


def breakdown_md(s: dict) -> str:
    """Per method: the verifier's round, split; then ms per committed token in those direct
    rounds against ms per token through the gateway, whose difference is the gateway hop
    (HTTP, SSE, detokenization, the gateway's own scheduling) per token."""
    rows = []
    gw = {(method, temp): 1e3 / row["all"] for (system, method, temp), row
          in s["throughput"].items() if system == "tandem" and row["all"] > 0}
    for (method, temp), v in sorted(s["speculation"].items(), key=lambda kv: kv[0][1]):
        b = v["breakdown"]
        if not b:
            continue
        tpr = v["rounds_mean_accepted_length"]
        direct = b["gap_ms"] / tpr if tpr else math.nan
        via = gw.get((method, temp), math.nan)
        rows.append([f"{method}, T={temp:g}", fmt(b["gap_ms"])] +
                    [fmt(b[key]) for key, _ in BREAKDOWN_PARTS] +
                    [fmt(tpr, ".2f"), str(b["rounds"]), fmt(direct), fmt(via), fmt(via - direct)])
    for temp, b in sorted((s.get("plain_rounds") or {}).items()):
        if b:  # the reference a speculative round must beat: one plain step per token
            via = gw.get(("none", temp), math.nan)
            rows.append([f"plain (none), T={temp:g}", fmt(b["gap_ms"])] +
                        [fmt(b[key]) for key, _ in BREAKDOWN_PARTS] +
                        ["1.00", str(b["rounds"]), fmt(b["gap_ms"]), fmt(via),
                         fmt(via - b["gap_ms"])])
    if not s.get("plain_rounds"):  # results from before plain ran on the verifier directly
        for (method, temp), via in sorted(gw.items(), key=lambda kv: kv[0][1]):
            if method == "none":
                rows.append([f"plain step (none), T={temp:g}", fmt(via), "", "", "", "",
                             "1.00", "from tokens/s", "", fmt(via), ""])
    return table(["method", "round (ms)"] + [name for _, name in BREAKDOWN_PARTS] +
                 ["tokens / round", "rounds", "ms / token, rounds", "ms / token, gateway",
                  "gateway hop"], rows)


def breakdown_by_k_md(s: dict) -> str:
    """Per method and k: the round's milliseconds and what they buy, ms per committed token."""
    plain = {temp: 1e3 / row["all"] for (system, method, temp), row in s["throughput"].items()
             if (system, method) == ("tandem", "none") and row["all"] > 0}
    # Prefer the plain step measured the same way, straight on the verifier.
    plain.update({t: b["gap_ms"] for t, b in (s.get("plain_rounds") or {}).items() if b})
    rows = []
    for (method, temp), v in sorted(s["speculation"].items(), key=lambda kv: kv[0][1]):
        for k, b in (v.get("breakdown_by_k") or {}).items():
            per_tok = b["gap_ms"] / b["tokens_per_round"] if b["tokens_per_round"] else math.nan
            rows.append([f"{method}, T={temp:g}", str(k), str(b["rounds"]), fmt(b["gap_ms"])] +
                        [fmt(b[key]) for key, _ in BREAKDOWN_PARTS] +
                        [fmt(b["tokens_per_round"], ".2f"), fmt(per_tok),
                         fmt(per_tok / plain[temp], ".2f") if temp in plain else ""])
    return table(["method", "k", "rounds", "round (ms)"] +
                 [name for _, name in BREAKDOWN_PARTS] +
                 ["tokens / round", "ms / token", "vs plain step"], rows)


def concurrency_md(s: dict) -> str:
    """One row per (level, method), as summary.concurrency_table orders them."""
    rows = [[str(c["sessions"]), c["method"], fmt(c["total_tps"]), fmt(c["vs_one"], ".2f", "x"),
             fmt(c["vs_none"], ".2f", "x"), fmt(c["itl_p50_ms"], ".0f"),
             fmt(c["itl_p99_ms"], ".0f"), fmt(c["ttft_p50_s"] * 1e3, ".0f"),
             fmt(c["ttft_p99_s"] * 1e3, ".0f")] for c in s["concurrency"]]
    return table(["sessions", "method", "total tokens/s", "vs 1 session", "vs none",
                  "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms"], rows,
                 text_cols=(0, 1))


def targets_md(s: dict) -> str:
    mark = {True: "met", False: "**missed**", None: "not measured"}
    rows = [[t["name"], fmt(t["goal"], ".2f"), fmt(t["measured"], ".2f"), mark[t["met"]],
             t["note"]] for t in s["targets"]]
    return table(["target", "goal", "measured", "", "note"], rows, text_cols=(0, 3, 4))


def _draft(meta: dict) -> str:
    info = meta.get("draft_info") or {}
    source = info.get("source", meta["draft"])
    with contextlib.suppress(ValueError):  # repo-relative when it is inside the checkout
        source = str(Path(source).relative_to(Path.cwd()))
    text = f"`{source}`"
    if info.get("snapshot"):
        text += " (copied at the start of the run"
        prog = info.get("progress") or {}
        if prog:
            text += f": {prog.get('steps')} training steps, validation top-1 " \
                    f"{fmt(prog.get('val_top1_teacher_forced'), '.3f')}"
        text += ")"
    arch = info.get("architecture")
    if arch:
        text += f", {arch.get('layers')} layers, hidden {arch.get('hidden')}, " \
                f"vocab {arch.get('vocab')}"
    return text


def _layer_skip_line(m: dict) -> str:
    ls = m.get("cost_layer_skip") or {}
    if not ls:
        return "- **Layer skip:** no skip set for this target (`tandem search-skip`): not served"
    return (f"- **Layer skip:** served in the verifier's process, skipping {len(ls['skip'])} of "
            f"the target's layers {ls['skip']} (`{Path(ls['file']).name}`); view/target 1-token "
            f"forward {fmt(ls.get('draft_ms'), '.2f')} / {fmt(ls.get('target_ms'), '.2f')} ms, "
            f"c = {fmt(ls.get('c'), '.3f')}")


def machine_md(mach: dict) -> str:
    """'<cpu>, <n> cores, no GPU' (or 'GPU <name>'), then where the models ran when the
    results say so (results from before --device do not)."""
    gpu = mach.get("gpu") or "none"
    text = f"{mach['cpu']}, {mach['cores']} cores, " + ("no GPU" if gpu == "none"
                                                         else f"GPU {gpu}")
    if mach.get("device"):
        text += f", models on {mach['device']} ({mach.get('dtype', '?')})"
    return text


def render_markdown(result: dict, s: dict, img_prefix: str) -> str:
    m, cfg = result["meta"], result["meta"]["config"]
    mach = m["machine"]
    load = ", ".join(f"{x:.2f}" for x in mach.get("load_avg_at_start", []))
    parts = [
        "# Tandem benchmarks", "",
        "Generated by `tandem bench" + (" --quick" if cfg["quick"] else "") + "`; do not edit "
        "by hand. Every figure below comes from one run, side by side.", "",
        f"- **Date:** {m['date']} (finished {m.get('finished', 'incomplete')})",
        f"- **Machine:** {machine_md(mach)}; torch {mach['torch']}, "
        f"transformers {mach['transformers']}, Python {mach['python']}; load average at "
        f"start {load}",
        f"- **Models:** target `{Path(m['target']).name}`, draft {_draft(m)}; draft/target "
        f"1-token forward {fmt((m.get('cost') or {}).get('draft_ms'), '.2f')} / "
        f"{fmt((m.get('cost') or {}).get('target_ms'), '.2f')} ms, "
        f"c = {fmt((m.get('cost') or {}).get('c'), '.3f')}",
        f"- **Run:** {len(m['prompt_tokens'])} prompts, {cfg['max_tokens']} new tokens each "
        f"(EOS ignored), k <= {cfg['k']}; cluster of 1 verifier + 1 draft worker, "
        f"{cfg['threads']} torch thread each, gateway over HTTP (streaming); transformers "
        f"peers in the benchmark process, {cfg.get('peer_threads', 1)} torch thread, "
        "before the cluster starts",
        _layer_skip_line(m),
        f"- **Suffix decoding:** cross-request cache {m.get('suffix_cache', 'on')}: every "
        "prompt is asked several times in this run; the repetitive workload that the cache "
        "is for is in benchmarks-repetitive.md (`tandem bench --workload repetitive`)",
        "- **Copy-heavy work:** speedup per category (repeat / quote, reformat / extract, code "
        "edit, correct text, summarise with citations, chat) and method, with its plot, is in "
        "[benchmarks-copy.md](benchmarks-copy.md) (`tandem bench --workload copy`); its "
        "plot:", "", f"![copy-heavy speedup per category and method]({img_prefix}"
        "benchmarks-copy.png)", "",
        "- **Wall time:** " + (", ".join(f"{k} {v:.0f} s" for k, v in m.get("phase_s", {}).items())
                               + f"; total {fmt(m.get('wall_s'), '.0f')} s"), ""]
    parts += [f"> **Error:** {e}\n" for e in m.get("errors", [])] + [
        "## Targets", "", targets_md(s), "",
        "## Single-session decode tokens/s", "", throughput_md(s), "",
        f"![speedup]({img_prefix}{PLOTS['speedup']})", "",
        "## Speculation", "", speculation_md(s), "", acceptance_md(s), "",
        f"![acceptance by position]({img_prefix}{PLOTS['acceptance']})", "",
        *shapes.shapes_section(result, s, img_prefix),
        "## Where a round's time goes", "", breakdown_md(s), "",
        f"![round breakdown]({img_prefix}{PLOTS['breakdown']})", "",
        "By k (drafts verified in the round): ms per committed token against a plain step's "
        "(below 1.00 pays).", "", breakdown_by_k_md(s), "",
        "## Concurrency (greedy, every method at each level)", "", concurrency_md(s), "",
        f"![concurrency]({img_prefix}{PLOTS['concurrency']})", "",
        "## Definitions", "", DEFINITIONS]
    return "\n".join(parts) + "\n"


DEFINITIONS = """\
- *Decode tokens/s* = (n − 1) / (time of last token − time of first token), from the client's
  side: SSE chunks for Tandem, transformers' streamer for the peers. TTFT is separate.
  Aggregates are total tokens over total time.
- *vs Tandem plain*: tokens/s over Tandem with `speculation.method = none` at the same
  temperature, through the same gateway, so only speculation differs.
- *a*: per-token acceptance, accepted / (accepted + rejections) over the verifier's rounds
  (\\* = accepted / drafted from the gateway's totals and k = the cap, when no round stats
  were collected at that temperature). *Rounds with drafts*: n-gram drafts nothing without a
  match, and the verifier may choose k = 0; S assumes every round drafts.
  *Per-position acceptance*: P(draft i accepted | drafts before it accepted).
- *Leviathan S* = (1 − a^(k+1)) / ((1 − a)(k·c + 1)) at the measured a, the mean k the
  verifier chose and c = draft / target 1-token forward time (0 for n-gram lookup); *best S*
  at the best k <= the cap. *of S* = measured speedup / S.
- *Gateway hop*: ms per token through the gateway (from tokens/s) minus ms per token of the
  direct rounds (round time / tokens per round): what HTTP, SSE, detokenization and the
  gateway's scheduling add per token (the two phases run one after the other, so host noise
  shows here too).
- *Round breakdown*: from the verifier's `GenerateResponse.round` (draft_wait_ms, verify_ms,
  rejection_ms), streamed straight from its gRPC `Generate`; the rest of the client-observed
  gap between two rounds is network, serialization and scheduling. The first round (prefill)
  is left out.
- *Concurrency*: n greedy sessions at once, a level's methods back to back (sharing host noise);
  *vs 1 session*: over the same method's tokens/s at 1; *vs none*: over none's at that level.
- *ITL*: each SSE chunk's gap spread evenly over its tokens (re-tokenized from its text).
- *Peers*: transformers `generate` on the same chat-templated prompts with EOS not stopping
  (like the gateway's `ignore_eos`), temperature only (no top-k/top-p, as Tandem's
  defaults); assisted generation with `num_assistant_tokens = k` (its own schedule and
  confidence threshold then adapt it) and the shipped draft re-wired to target ids; prompt
  lookup with `prompt_lookup_num_tokens = k`. Tandem requests carry no seed."""


def write_plots(s: dict, out_dir: Path) -> list[Path]:
    from tools.bench import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    return plots.write_all(s, out_dir, PLOTS, BREAKDOWN_PARTS, LABELS)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {(" ".join(map(str, k)) if isinstance(k, tuple) else k): _jsonable(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def write_outputs(result: dict, out_dir: Path, docs_dir: Path | None) -> dict:
    """results.json (raw + summary), report.md and PNGs; then docs/results/benchmarks.md +
    docs/results/img."""
    out_dir.mkdir(parents=True, exist_ok=True)
    s = summarize(result)
    (out_dir / "results.json").write_text(json.dumps(_jsonable({**result, "summary": s}),
                                                     indent=1))
    pngs = write_plots(s, out_dir)
    (out_dir / "report.md").write_text(render_markdown(result, s, ""))
    if docs_dir is not None:
        (docs_dir / "img").mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copy(p, docs_dir / "img" / p.name)
        (docs_dir / "benchmarks.md").write_text(render_markdown(result, s, "img/"))
    return s
