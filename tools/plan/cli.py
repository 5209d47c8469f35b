"""`tandem plan`: capacity planning by simulation (docs/reference/plan.md).

  tandem plan simulate --verifiers 2 --drafts 2 --method draft_model --concurrency 16 \\
      --profile cpu-host --out out/plan            # -> out/plan/plan.json
  tandem plan calibrate --out profile.json          # this host's verify / draft / hop costs
  tandem plan acceptance rounds.jsonl --out acc.json   # recorded rounds -> acceptance table
  tandem plan roofline --gpu h100 --model-config config.json --out h100.json
  tandem plan validate                               # the local cluster against the simulation
  tandem plan size --traffic-rate 20 --slo-ttft-ms 500 --slo-tpot-ms 50   # pod counts
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.plan.config import METHODS, SimConfig


def add_sim_flags(p: argparse.ArgumentParser) -> None:
    """The deployment and traffic flags shared by simulate and size."""
    g = p.add_argument_group("deployment")
    g.add_argument("--verifiers", type=int, default=1, help="verifier pods (default 1)")
    g.add_argument("--drafts", type=int, default=1,
                   help="draft worker pods (draft_model, eagle; default 1)")
    g.add_argument("--method", default="none", choices=METHODS, help="speculation method")
    g.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="the requests' k cap (0: the verifier's --max-spec-tokens)")
    g.add_argument("--max-spec-tokens", type=int, default=16, help="the verifiers' k cap")
    g.add_argument("--max-num-seqs", type=int, default=32, help="sessions per verifier step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-tokens", type=int, default=256)
    g.add_argument("--max-draft-wait-ms", type=float, default=25.0)
    g.add_argument("--no-batch-plan", dest="batch_plan", action="store_false",
                   help="each session keeps its single-session k under batch load")
    g.add_argument("--profile", default="cpu-host",
                   help="cost profile: a JSON file or a built-in name (tools/plan/profiles)")
    g.add_argument("--acceptance", default="",
                   help="acceptance table JSON (`tandem plan acceptance`); default: built-in")
    t = p.add_argument_group("traffic (one of --concurrency, --rate, --trace)")
    t.add_argument("--concurrency", type=int, default=0, help="closed loop: C clients")
    t.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson, requests/s")
    t.add_argument("--trace", default="",
                   help="JSON lines {t (s), prompt_tokens, max_tokens, conversation}")
    t.add_argument("--prompt-tokens", type=int, default=256)
    t.add_argument("--max-tokens", type=int, default=128)
    t.add_argument("--requests", type=int, default=100)
    t.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="leading prompt tokens all requests share (prefix caching)")
    t.add_argument("--seed", type=int, default=0)


def sim_config(args: argparse.Namespace) -> SimConfig:
    names = set(SimConfig.__dataclass_fields__)
    return SimConfig(**{k: v for k, v in vars(args).items() if k in names})


def load_acceptance(path: str, method: str):
    """The method's acceptance from a table file; None: the built-in default."""
    if not path:
        return None
    from tools.plan.acceptance import table_from_json
    table = table_from_json(json.loads(Path(path).read_text()))
    if method not in table:
        raise ValueError(f"{path} has no acceptance for {method} (it has {sorted(table)})")
    return table[method]


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tools.plan.profile import load_profile
    from tools.plan.sim import simulate

    cfg = sim_config(args)
    profile = load_profile(args.profile)
    acc = load_acceptance(args.acceptance, cfg.method)
    total = cfg.requests if not cfg.trace else None
    with tqdm(total=total, desc="simulating", unit="req", disable=not args.progress,
              file=sys.stderr) as bar:
        result = simulate(cfg, profile, acc, progress=lambda: bar.update(1))
    out = Path(args.out)
    out = out if out.suffix == ".json" else out / "plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    keys = ("throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
            "acceptance_length_mean", "preemptions", "requests_per_wall_s")
    print(f"simulation ({profile.name}: {profile.source}) -> {out}")
    for k in keys:
        print(f"  {k:24s} {result[k]:.2f}" if isinstance(result[k], float)
              else f"  {k:24s} {result[k]}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="capacity planning by simulation, validated "
                              "against the running cluster", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="plan_command", required=True)
    s = sub.add_parser("simulate", help="simulate a deployment under a load -> plan.json")
    add_sim_flags(s)
    s.add_argument("--out", default="plan-out", help="directory (or .json file) to write")
    s.add_argument("--no-progress", dest="progress", action="store_false")
    s.set_defaults(func=cmd_simulate)
    from tools.plan.cli_more import register_more
    register_more(sub)
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
