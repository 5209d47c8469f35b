"""`tandem search-skip`: search a target's layer-skip set and save it with the model."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tandem.device import add_device_flags
from tandem.envflags import add_flag

_DEFAULT_OUT = "<checkpoint>/layer_skip.json"


def register(sub) -> None:
    p = sub.add_parser(
        "search-skip", help="find the layers a self-speculative (layer_skip) draft leaves out",
        description="Bayesian optimisation (Optuna TPE) over which decoder layers the "
        "layer_skip draft skips, maximising the speedup estimated from measured acceptance "
        "(greedy, along the target's own paths) and the measured cost of the reduced model. "
        "Saves the best set next to the checkpoint, where verifiers and draft workers find it, "
        "with a JSON of every trial and a plot.")
    add_flag(p, "--model", "TANDEM_MODEL", "default", help="target: default name or HF dir")
    add_flag(p, "--prompts", "TANDEM_SEARCH_PROMPTS", "",
             help="JSONL of {\"prompt\": ...} chat prompts (default: the held-out set)")
    add_flag(p, "--num-prompts", "TANDEM_SEARCH_NUM_PROMPTS", 8, int, help="prompts used")
    add_flag(p, "--trials", "TANDEM_SEARCH_TRIALS", 60, int, help="skip sets tried")
    add_flag(p, "--objective", "TANDEM_SEARCH_OBJECTIVE", "pipelined",
             help="cost model of a round: pipelined (the draft runs concurrently with "
                  "verification, as Tandem runs it) or serial (Leviathan: they take turns)")
    add_flag(p, "--k", "TANDEM_SEARCH_K", 8, int, help="longest proposal scored (1..16)")
    add_flag(p, "--max-new-tokens", "TANDEM_SEARCH_MAX_NEW_TOKENS", 48, int,
             help="length of each target path the drafts are scored along")
    add_flag(p, "--threads", "TANDEM_SEARCH_THREADS", 1, int,
             help="torch threads for the timed forwards (1: a batch-1 forward's share)")
    add_flag(p, "--seed", "TANDEM_SEARCH_SEED", 0, int, help="sampler seed")
    add_device_flags(p, "TANDEM_SEARCH_SKIP", dtype_help=(
        "target weight dtype: auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, "
        "float16, int8 (cpu weight-only); search with the dtype the verifier serves"))
    add_flag(p, "--out", "TANDEM_SEARCH_OUT", _DEFAULT_OUT, help="where the best set is saved")
    add_flag(p, "--report", "TANDEM_SEARCH_REPORT", "",
             help="JSON of every trial (default: next to --out, layer_skip_trials.json)")
    add_flag(p, "--plot", "TANDEM_SEARCH_PLOT", "",
             help="PNG of the trials (default: next to --out, layer_skip_trials.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from tandem.device import place
    from tandem.engine.llama import LlamaModel
    from tandem.models import generation_eos_ids, resolve_model
    from tools.distill.acceptance import load_prompts
    from tools.distill.corpus import Prompt, encode_prompt
    from tools.skip_search import SearchConfig, search, summary

    at = place(args.device, args.dtype)  # a GPU this host lacks fails here, before the work
    cfg = SearchConfig(trials=args.trials, objective=args.objective, k=args.k,
                       max_new_tokens=args.max_new_tokens,
                       num_prompts=args.num_prompts, seed=args.seed,
                       timing_threads=args.threads)
    paths = resolve_model(args.model)
    out = paths.root / "layer_skip.json" if args.out == _DEFAULT_OUT else Path(args.out)
    report = Path(args.report) if args.report else out.with_name("layer_skip_trials.json")
    plot = Path(args.plot) if args.plot else out.with_name("layer_skip_trials.png")
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    texts = load_prompts(Path(args.prompts) if args.prompts else None)
    prompts = [encode_prompt(tok, Prompt("chat", t, "search")) for t in texts]
    torch.set_num_threads(args.threads)
    model = LlamaModel.load(paths, at.dtype, device=at.device)
    # Every end-of-reply id (Gemma 3 ends a turn with <end_of_turn>, not only <eos>)
    stop = tuple(dict.fromkeys(generation_eos_ids(paths) + tuple(
        t for t in [tok.eos_token_id] if t is not None)))
    print(f"searching {cfg.trials} skip sets of {model.cfg.num_layers} layers on "
          f"{min(len(prompts), cfg.num_prompts)} prompts, target on {at}", file=sys.stderr)
    results = search(model, prompts, stop, cfg)
    best = max(results, key=lambda r: r.speedup)
    info = summary(best, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(best.skip.to_json(model=paths.root.name, **info))
    report.write_text(json.dumps({"model": paths.root.name, "config": dataclasses.asdict(cfg),
                                  "device": str(at.device), "dtype": at.dtype,
                                  "best": {"skip": list(best.skip.skip), **info},
                                  "trials": [_trial(r) for r in results]}, indent=1) + "\n")
    print(f"best: skip {list(best.skip.skip)} -> estimated speedup {best.speedup:.3f} at "
          f"k={best.k} (alpha {best.alpha:.3f}, c {best.c:.3f}); saved {out}")
    if best.speedup <= 1.0:
        print("note: no skip set beats plain decoding on this model; the verifier's cost model "
              "will keep layer_skip proposals short or off", file=sys.stderr)
    _plot(results, plot)
    return 0


def _trial(r) -> dict:
    return {"skip": list(r.skip.skip), "speedup": round(r.speedup, 4), "k": r.k,
            "alpha": round(r.alpha, 4), "c": round(r.c, 4)}


def _plot(results, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = range(len(results))
    speeds = [r.speedup for r in results]
    best = [max(speeds[:i + 1]) for i in xs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    a.scatter(xs, speeds, s=14, c=[len(r.skip.skip) for r in results], cmap="viridis")
    a.plot(xs, best, color="tab:red", label="best so far")
    a.axhline(1.0, color="grey", ls="--", lw=1, label="plain decoding")
    a.set(xlabel="trial", ylabel="estimated speedup", title="search-skip trials")
    a.legend()
    sc = b.scatter([r.c for r in results], [r.alpha for r in results], c=speeds, s=16,
                   cmap="viridis")
    b.set(xlabel="draft cost c (view / target forward)", ylabel="acceptance alpha",
          title="cost against acceptance")
    fig.colorbar(sc, ax=b, label="estimated speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)
