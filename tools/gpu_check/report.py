"""gpu-check's outputs: one JSON with every phase's report, one markdown summary (plots by
tools/gpu_check/plots.py)."""
from __future__ import annotations

import json
from pathlib import Path

JSON_NAME, MD_NAME = "gpu-check.json", "gpu-check.md"


def recommendations(phases: dict[str, dict]) -> dict:
    """What the measurements say to set: graphs per batch where they gained >= 5 % (captured
    on a GPU only), and the fastest agreeing attention kernel per layout."""
    out: dict = {}
    graphs = phases.get("cuda_graphs", {}).get("results", {})
    if graphs.get("captured") and graphs.get("decode_step_ms"):
        out["cuda_graphs_gain_at_batch"] = {b: r["gain"] for b, r in
                                            graphs["decode_step_ms"].items()}
        out["cuda_graphs_auto_should_enable"] = any(
            r["gain"] >= 1.05 for r in graphs["decode_step_ms"].values())
    else:
        out["cuda_graphs_auto_should_enable"] = None  # not measured with captured graphs
    layouts = phases.get("attention", {}).get("results", {}).get("layouts", {})
    out["attention_fastest"] = {k: v.get("fastest") for k, v in layouts.items()}
    return out


def write_json(out: Path, summary: dict) -> Path:
    path = out / JSON_NAME
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return path


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _correctness(res: dict) -> list[str]:
    checks = res.get("checks", {})
    bad = [k for k, c in checks.items() if not c["ok"]]
    lines = [f"{len(checks) - len(bad)} of {len(checks)} checks passed."]
    if bad:
        lines.append("Failed: " + ", ".join(f"`{b}` ({checks[b]['detail']})" for b in bad))
    fam = res.get("families", {})
    if fam:
        lines += [""] + _table(["family", "max abs logit diff (fp32)", "greedy same",
                                "bf16 argmax agreement"],
                               [[k, f"{v['max_abs_logit_diff']:.2e}", v["greedy_same"],
                                 v.get("bf16_argmax_agreement", "-")] for k, v in fam.items()])
    return lines


def _verify_cost(res: dict) -> list[str]:
    lines = [f"Forward ms over q new tokens per sequence, context {res.get('context')} "
             "(ratio to q = 1 at the same batch in brackets)."]
    for model, curve in res.get("curves", {}).items():
        qs = list(next(iter(curve.values()), {}))
        rows = [[b] + [f"{ms:.2f} ({ms / row['1']:.2f})" for ms in row.values()]
                for b, row in curve.items()]
        lines += ["", f"**{model}**", ""] + _table(["batch"] + [f"q={q}" for q in qs], rows)
    return lines


def _simple(phase: str, res: dict) -> list[str]:
    if phase == "decode":
        return _table(["model", "batch", "tokens/s"],
                      [[m, b, t] for m, row in res.get("tokens_per_s", {}).items()
                       for b, t in row.items()])
    if phase == "cuda_graphs":
        same = res.get("same_output", {})
        replayed = "graphs ms" if res.get("captured") else "padded eager ms (no capture)"
        return [f"Same output: {same}. Captured: {res.get('captured')}.", ""] + _table(
            ["batch", "eager ms", replayed, "gain", "first call ms"],
            [[b, r["eager_ms"], r["graph_ms"], r["gain"], r["first_call_ms"]]
             for b, r in res.get("decode_step_ms", {}).items()])
    if phase == "attention":
        rows = [[name, kname, v["ms"], v["first_call_ms"], f"{v['max_abs_diff']:.1e}"]
                for name, row in res.get("layouts", {}).items()
                for kname, v in row.items() if isinstance(v, dict)]
        return [f"dtype {res.get('dtype')}, flash-attn installed: "
                f"{res.get('flash_installed')}", ""] + _table(
            ["layout", "kernel", "ms", "first call ms", "max abs diff vs CPU fp32"], rows)
    if phase == "colocate":
        keys = ("alone_s", "together_s", "slowdown", "overlap")
        return [f"- {k}: {res.get(k)}" for k in keys]
    return []


def write_markdown(out: Path, summary: dict, plots: list[str]) -> Path:
    lines = [f"# tandem gpu-check on {summary['device_name']}", "",
             f"torch {summary['torch']}, CUDA {summary['cuda']}, tiny={summary['tiny']}, "
             f"total {summary['total_s']:.1f} s; all phases ok: **{summary['all_ok']}**", ""]
    lines += _table(["phase", "status", "seconds", "box s"],
                    [[n, p["status"], p["seconds"], p["box_s"]]
                     for n, p in summary["phases"].items()])
    for name, phase in summary["phases"].items():
        lines += ["", f"## {name}", "", phase["about"], ""]
        if "error" in phase:
            lines += [f"**{phase['status']}**: {phase['error']}", ""]
        res = phase.get("results", {})
        if name == "correctness":
            lines += _correctness(res)
        elif name == "verify_cost":
            lines += _verify_cost(res)
        else:
            lines += _simple(name, res)
    lines += ["", "## recommendations", "", "```",
              json.dumps(summary.get("recommendations", {}), indent=1), "```"]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    path = out / MD_NAME
    path.write_text("\n".join(lines) + "\n")
    return path
