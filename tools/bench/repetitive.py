"""`tandem bench --workload repetitive`: the workload suffix decoding is for, side by side.

Requests: every chat question and every code edit (rewrite code given in the prompt) of
tools/bench/prompts.jsonl, asked `repeats` times, round robin (all once, then all again), as
users and agents ask the same things again. Systems, interleaved per request so host drift hits
every method alike: Tandem plain / ngram / suffix through the gateway of one fresh cluster
(suffix's cross-request cache starts empty and fills from the workload's own earlier answers),
and transformers plain / prompt lookup in this process, before the cluster starts.

Headline: workload tokens/s = all tokens / all request time (time to first token included).
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from tandem.device import place
from tools.bench.config import BenchConfig, load_prompts
from tools.bench.host import children_log_to, machine, release_memory
from tools.bench.report import fmt, machine_md, table

TANDEM = ("none", "ngram", "suffix")
PEERS = ("plain", "prompt_lookup")
CATEGORIES = ("chat", "code")
LABELS = {("tandem", "none"): "Tandem plain", ("tandem", "ngram"): "Tandem ngram",
          ("tandem", "suffix"): "Tandem suffix", ("transformers", "plain"): "transformers plain",
          ("transformers", "prompt_lookup"): "transformers prompt lookup"}
WARM_UP = "Say hello."  # not a workload prompt: the suffix cache learns nothing useful from it


def workload(prompts: list[dict], repeats: int) -> list[dict]:
    picks = [p for p in prompts if p["category"] in CATEGORIES]
    return [{**p, "ask": r} for r in range(repeats) for p in picks]


def run_repetitive(cfg: BenchConfig, repeats: int, result: dict, out_dir: Path) -> dict:
    """Fills `result` as it goes (an interruption keeps what was measured)."""
    from transformers import AutoTokenizer

    from tandem.models import resolve_model
    from tools.bench.client import chat_body, run_single
    from tools.launcher import Cluster, ClusterConfig, free_port

    at = place(cfg.device, cfg.dtype)
    target = str(resolve_model(cfg.model or None).root)
    tok = AutoTokenizer.from_pretrained(target)
    reqs = workload(load_prompts(0, cfg.prompt_ids), repeats)
    ids = {r["id"]: list(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)) for r in reqs}
    result.update(meta={"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "machine": machine(at), "config": asdict(cfg), "repeats": repeats,
                        "requests": len(reqs), "workload": "repetitive"}, rows=[])
    total = len(reqs) * (len(TANDEM) + (len(PEERS) if cfg.peers else 0))
    with tqdm(total=total, unit="req") as bar:
        if cfg.peers:
            _run_peers(cfg, target, reqs, ids, result, bar, at)
        # No draft model or head: ngram and suffix need none, and loading them costs memory.
        cluster = Cluster(ClusterConfig(gateway_port=free_port(), model=cfg.model,
                                        draft_model="none", eagle="none",
                                        threads=cfg.threads, device=cfg.device,
                                        dtype=cfg.dtype), log=lambda m: None)
        try:
            bar.set_description("starting the cluster")
            with children_log_to(out_dir / "cluster.log"):
                cluster.start()
            url = cluster.gateway_url
            for method in TANDEM:
                run_single(url, chat_body(WARM_UP, 8, 0.0, method, cfg.k))
            for r in reqs:
                for method in TANDEM:
                    bar.set_description(f"tandem {method} {r['id']} ask {r['ask'] + 1}")
                    body = chat_body(r["prompt"], cfg.max_tokens, 0.0, method, cfg.k)
                    result["rows"].append(_row(r, "tandem", method, run_single(url, body)))
                    bar.update()
        finally:
            cluster.stop()
    result["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return result


def _run_peers(cfg, target, reqs, ids, result, bar, at=None) -> None:
    import torch

    from tools.bench.baselines import load_target, run_peer

    torch.set_num_threads(cfg.peer_threads or torch.get_num_threads())
    model = load_target(target, at)
    for method in PEERS:
        run_peer(model, None, ids[reqs[0]["id"]], method, 4, 0.0, cfg.k)
    for r in reqs:
        for method in PEERS:
            bar.set_description(f"transformers {method} {r['id']} ask {r['ask'] + 1}")
            out = run_peer(model, None, ids[r["id"]], method, cfg.max_tokens, 0.0, cfg.k)
            result["rows"].append(_row(r, "transformers", method, out))
            bar.update()
    del model
    release_memory(at)


def _row(r: dict, system: str, method: str, out: dict) -> dict:
    return {"system": system, "method": method, "prompt_id": r["id"],
            "category": r["category"], "ask": r["ask"], **out}


def summarize(result: dict) -> dict:
    """Per system/method: workload tokens/s overall, on first asks and on repeats, speedup vs
    Tandem plain, and the drafts' acceptance and tokens per round (Tandem)."""
    groups: dict[tuple[str, str], dict] = {}
    for part in ("all", "first", "repeat"):
        for (system, method), rows in _by_method(result["rows"], part).items():
            tokens = sum(x["tokens"] for x in rows)
            secs = sum(x["e2e_s"] for x in rows)
            spec = [x.get("speculation") or {} for x in rows]
            rounds = sum(s.get("rounds", 0) for s in spec)
            drafted = sum(s.get("drafted_tokens", 0) for s in spec)
            accepted = sum(s.get("accepted_tokens", 0) for s in spec)
            groups.setdefault((system, method), {})[part] = {
                "tokens": tokens, "tps": tokens / secs if secs else float("nan"),
                "tokens_per_round": tokens / rounds if rounds else float("nan"),
                "acceptance": accepted / drafted if drafted else float("nan")}
    base = groups.get(("tandem", "none"), {})
    for parts in groups.values():
        for part, g in parts.items():
            ref = base.get(part, {}).get("tps")
            g["speedup"] = g["tps"] / ref if ref else float("nan")
    return groups


def _by_method(rows: list[dict], part: str) -> dict:
    keep = {"all": lambda x: True, "first": lambda x: x["ask"] == 0,
            "repeat": lambda x: x["ask"] > 0}[part]
    out: dict[tuple[str, str], list[dict]] = {}
    for x in rows:
        if keep(x):
            out.setdefault((x["system"], x["method"]), []).append(x)
    return out


def render(result: dict, s: dict, img: str) -> str:
    m, c = result["meta"], result["meta"]["config"]
    rows = []
    for key, label in LABELS.items():
        g = s.get(key)
        if g is None:
            continue
        a, f, r = g.get("all", {}), g.get("first", {}), g.get("repeat", {})
        rows.append([label, fmt(a.get("tps")), fmt(a.get("speedup"), ".2f", "x"),
                     fmt(f.get("speedup"), ".2f", "x"), fmt(r.get("speedup"), ".2f", "x"),
                     fmt(a.get("acceptance"), ".2f"), fmt(a.get("tokens_per_round"), ".2f")])
    mc = m["machine"]
    return "\n".join([
        "# Tandem benchmark: a repetitive workload", "",
        "Generated by `tandem bench --workload repetitive`; do not edit by hand. One run, "
        "every method interleaved per request.", "",
        f"- **Date:** {m['date']} (finished {m.get('finished', '–')})",
        f"- **Machine:** {machine_md(mc)}; torch {mc['torch']}; "
        f"load average at start {', '.join(f'{x:.2f}' for x in mc['load_avg_at_start'])}",
        f"- **Workload:** {m['requests']} requests: every chat question and code edit of "
        f"`tools/bench/prompts.jsonl`, asked {m['repeats']} times round robin; greedy, "
        f"{c['max_tokens']} new tokens each (EOS ignored), k <= {c['k']}. Tandem: 1 verifier "
        "+ 1 draft worker through the gateway (streaming); suffix's cache starts empty.",
        "- **tokens/s** = all tokens / all request time, time to first token included; "
        "**speedup** = the same against Tandem plain over the same requests; first ask / "
        "repeats split the requests by whether the question was asked before.", "",
        table(["system", "tokens/s", "speedup", "first ask", "repeats", "acceptance",
               "tokens/round"], rows), "",
        f"![repetitive workload]({img}bench-repetitive.png)", ""])


def plot(s: dict, path: Path) -> Path:
    from tools.bench import plots

    plt = plots.plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    parts = ("first", "repeat", "all")
    keys = [k for k in LABELS if k in s]
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        ys = [plots._nan0(s[key].get(p, {}).get("speedup")) for p in parts]
        ax.bar([g + i * width - 0.4 + width / 2 for g in range(len(parts))], ys, width,
               label=LABELS[key])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(2.0, color="red", lw=0.8, ls="--", label="target 2x (suffix)")
    ax.set_xticks(range(len(parts)), ["first ask", "repeats", "whole workload"])
    ax.set_ylabel("tokens/s vs Tandem plain")
    ax.set_title("Repetitive workload: questions asked again, code edits")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return plots._save(fig, path)


def write_outputs(result: dict, out_dir: Path, docs_dir: Path | None) -> dict:
    import json
    import shutil

    from tools.bench.report import _jsonable

    out_dir.mkdir(parents=True, exist_ok=True)
    s = summarize(result)
    (out_dir / "results.json").write_text(json.dumps(_jsonable({**result, "summary": s}),
                                                     indent=1))
    png = plot(s, out_dir / "bench-repetitive.png")
    (out_dir / "report.md").write_text(render(result, s, ""))
    if docs_dir is not None:
        (docs_dir / "img").mkdir(parents=True, exist_ok=True)
        shutil.copy(png, docs_dir / "img" / png.name)
        (docs_dir / "benchmarks-repetitive.md").write_text(render(result, s, "img/"))
    print("\n" + render(result, s, ""))
    return s
