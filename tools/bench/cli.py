"""`tandem bench`: wire with `register(subparsers)`; also runnable as `python -m tools.bench.cli`.

  tandem bench --quick                   # ~5 min: one prompt per category, 64 tokens
  tandem bench --shape-methods eagle     # chain vs tree for eagle only ('' skips the phase)
  tandem bench                           # everything: 15 prompts, 128 tokens, T=0 and 0.7
  tandem bench --concurrency 1,16 --concurrency-methods none,ngram   # a short load run
  tandem bench --workload repetitive     # questions asked again, code edits: suffix vs ngram
  tandem bench --workload copy           # copy-heavy tasks: ngram / suffix / auto vs plain
  tandem bench --workload copy --history verifier --repeats 1 --arms ngram,suffix,auto --docs ''
  tandem bench --workload categories     # short answers by category: none/ngram/suffix/auto
  tandem bench --report results/bench-2026-11-21/results.json   # re-render only
  tandem bench --device cuda:1           # peers, cost timings and the cluster on one GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tandem.device import add_device_flags


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="subset in about five minutes: one prompt per category, 64 tokens, "
                        "greedy-only peers and round stats, chain vs tree on the first 3 "
                        "prompts, concurrency 1,4,8 for none,ngram,draft_model")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 128; "
                   "--quick 64)")
    p.add_argument("--k", type=int, default=16, help="draft tokens per round at most, for "
                   "Tandem (its cost model picks each round's k up to this: the verifier's "
                   "default cap) and the transformers peers (default %(default)s)")
    p.add_argument("--temperatures", type=_floats, help="Tandem temperatures (default 0,0.7)")
    p.add_argument("--peer-temperatures", type=_floats, help="temperatures of the transformers "
                   "peers (default 0,0.7; --quick 0)")
    p.add_argument("--round-temperatures", type=_floats, help="temperatures of the direct "
                   "verifier runs that give per-round stats (default 0,0.7; --quick 0)")
    p.add_argument("--concurrency", type=_ints, help="concurrent sessions to run "
                   "(default 1,4,16,32; --quick 1,4,8)")
    p.add_argument("--concurrency-methods", type=_names, help="methods each concurrency "
                   "level runs, interleaved within the level (default: none and every "
                   "method the single-session phase runs; --quick none,ngram,draft_model)")
    p.add_argument("--shape-methods", type=_names, help="methods the chain-vs-tree phase "
                   "runs with draft_shape chain and tree, greedy, interleaved per prompt with "
                   "plain decoding; a method whose head the run lacks is skipped (default "
                   "eagle,medusa; '' skips the phase; --quick: on the first 3 prompts only)")
    p.add_argument("--per-category", type=int, help="prompts per category, 0 = all "
                   "(default 0; --quick 1)")
    p.add_argument("--prompts", type=lambda t: tuple(x for x in t.split(",") if x),
                   help="only these prompt ids of tools/bench/prompts.jsonl (smoke runs); "
                        "copy workload: indices into tools/bench/copy_prompts.py's PROMPTS")
    p.add_argument("--model", default="", help="target model (default: the default target)")
    p.add_argument("--eagle", default="", help="EAGLE head directory, 'none' for no eagle "
                   "(default: the shipped head)")
    p.add_argument("--draft-model", default="", help="draft checkpoint directory (default: "
                   "the shipped draft, draft_service/weights/smollm2-135m-draft)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process "
                   "(default %(default)s: verifier and draft each keep one core busy)")
    add_device_flags(p, "TANDEM_BENCH", dtype_help=(
        "weight dtype of every model the run loads: the transformers peers, the cost timings "
        "and the cluster's verifier and draft worker: auto (float32 on cpu, bfloat16 on "
        "cuda), float32, bfloat16, float16, int8 or int8-bf16 (cpu; the peers then stay "
        "float32)"))
    p.add_argument("--peer-threads", type=int, help="torch threads of the transformers "
                   "peers (default 1, like each worker; 0 = torch's default)")
    p.add_argument("--seed", type=int, help="send this seed with sampled Tandem requests "
                   "(default none, as most users send them)")
    p.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    p.add_argument("--out", default="", help="results folder (default results/bench-<date>)")
    p.add_argument("--docs", default="docs/results",
                   help="write <docs>/benchmarks.md and <docs>/img (default %(default)s); "
                   "'' to skip")
    p.add_argument("--workload", choices=("standard", "repetitive", "copy", "categories"),
                   default="standard",
                   help="standard: every method on the prompt set; repetitive: chat questions "
                        "and code edits asked again (plain, ngram, suffix, transformers plain "
                        "and prompt lookup), written to <docs>/benchmarks-repetitive.md; copy: "
                        "copy-heavy tasks and chat (plain, ngram, suffix, auto; drafted in the "
                        "verifier and by a worker), written to <docs>/benchmarks-copy.md; "
                        "categories: short answers by category (tools/bench/categories.py)")
    p.add_argument("--repeats", type=int, default=None, help="repetitive / copy workload: "
                   "times each request is asked (default 3 / 2)")
    p.add_argument("--history", type=_names, default=("verifier", "worker"),
                   help="copy workload: where ngram and suffix draft, one cluster each "
                        "(verifier, worker; default both)")
    p.add_argument("--arms", type=_names, default=(), help="copy workload: only these "
                   "methods beside plain (default: every arm but the opt-in layer_skip)")
    p.add_argument("--first-reps", type=int, default=1, help="copy workload: independent "
                   "first asks per prompt and arm, each pass as fresh tenants (default 1)")
    p.add_argument("--report", metavar="RESULTS_JSON", help="only re-render the report and "
                   "plots from a saved results.json")


def config_from_args(args):
    from tools.bench.config import BenchConfig, quick_config

    overrides = {"k": args.k, "model": args.model, "draft_model": args.draft_model,
                 "eagle": args.eagle,
                 "threads": args.threads, "peers": not args.no_peers,
                 "device": args.device, "dtype": args.dtype,
                 "prompt_ids": args.prompts or ()}
    for name in ("max_tokens", "temperatures", "peer_temperatures", "round_temperatures",
                 "concurrency", "concurrency_methods", "shape_methods", "per_category",
                 "peer_threads", "seed"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return quick_config(**overrides) if args.quick else BenchConfig(**overrides)


def _print_summary(s: dict, out: Path) -> None:
    from tools.bench.report import concurrency_md, targets_md, throughput_md
    from tools.bench.shapes import shapes_md

    shapes = "\n\n" + shapes_md(s["shapes"]) if s.get("shapes") else ""
    print("\n" + throughput_md(s) + shapes + "\n\n" + concurrency_md(s) + "\n\n"
          + targets_md(s))
    print(f"\nwrote {out}/results.json, report.md and plots")


def cmd_bench(args) -> int:
    """Run a workload (or re-render a saved one) and write its results, report and docs."""
    if args.repeats is not None and args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    docs = Path(args.docs) if args.docs else None
    if args.workload == "categories":
        from tools.bench.categories import run_workload as run_categories

        run_categories(args.first_reps, args.max_tokens or 192,
                       Path(args.out or "results/categories") / "results.json", args.arms,
                       tuple(int(i) for i in (args.prompts or ())))
        return 0
    if args.workload == "copy":
        from tools.bench.copy_heavy import rerender, run_workload

        if args.report:
            rerender(args.report, str(docs or Path(args.report).parent))
            return 0
        temps = args.temperatures or (0.0,)
        if len(temps) != 1 or args.first_reps < 1:
            print("--workload copy takes one temperature and --first-reps >= 1",
                  file=sys.stderr)
            return 2
        out = Path(args.out or f"results/bench-copy-{time.strftime('%Y-%m-%d', time.gmtime())}")
        run_workload(args.max_tokens or 256, args.repeats or 2, places=args.history,
                     temperature=temps[0], out=out / "results.json", docs=docs,
                     arms=args.arms, model=args.model, first_reps=args.first_reps,
                     picks=tuple(int(i) for i in (args.prompts or ())))
        return 0
    saved = _restore(json.loads(Path(args.report).read_text())) if args.report else None
    repetitive = (saved.get("meta", {}).get("workload") if saved is not None
                  else args.workload) == "repetitive"
    write = _write_repetitive if repetitive else _write_standard
    if saved is not None:
        write(saved, Path(args.out) if args.out else Path(args.report).parent, docs)
        return 0
    config = config_from_args(args)
    from tandem.device import place

    place(config.device, config.dtype)  # a GPU this host lacks: a clear error, before any work
    name = "bench-repetitive" if repetitive else "bench"
    out = Path(args.out or f"results/{name}-{time.strftime('%Y-%m-%d', time.gmtime())}")
    result: dict = {}
    code = 0
    try:
        if repetitive:
            from tools.bench.repetitive import run_repetitive

            run_repetitive(config, args.repeats or 3, result, out)
        else:
            from tools.bench.runner import run_bench

            run_bench(config, result, out)
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", file=sys.stderr)
        result.setdefault("meta", {})["incomplete"] = "interrupted"
        code = 130
    if not (result.get("runs") or result.get("concurrency") or result.get("rows")):
        return code or 1
    write(result, out, docs)
    return code


def _write_standard(result: dict, out: Path, docs: Path | None) -> None:
    from tools.bench.report import write_outputs

    _print_summary(write_outputs(result, out, docs), out)


def _write_repetitive(result: dict, out: Path, docs: Path | None) -> None:
    from tools.bench.repetitive import write_outputs

    write_outputs(result, out, docs)


def _restore(result: dict) -> dict:
    """results.json holds the raw result plus its summary; only the raw part is needed."""
    return {k: v for k, v in result.items() if k != "summary"}


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark Tandem against transformers peers, side by side, with plots",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as exc:  # as `tandem bench` reports it (tools.cli.main)
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
