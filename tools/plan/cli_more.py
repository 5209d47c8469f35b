"""`tandem plan` sub-commands beyond simulate: calibrate, acceptance, roofline, validate, size."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tools.plan.calibrate import calibrate_host
    from tools.plan.profile import save_profile

    profile = calibrate_host(args.model, args.draft_model, args.threads, args.reps, args.name)
    save_profile(profile, Path(args.out))
    print(f"profile {profile.name} -> {args.out}\n  verify ms by tokens: "
          f"{ {q: round(v, 2) for q, v in profile.verify_ms.items()} }\n  draft ms by batch: "
          f"{ {b: round(v, 2) for b, v in profile.draft_ms.items()} }\n  hop ms: "
          f"{profile.net_latency_ms}")
    return 0


def cmd_acceptance(args: argparse.Namespace) -> int:
    """Recorded rounds (JSON lines {"method", "workload", "drafted", "accepted"}, as
    `tandem plan validate` writes them from the SSE round events) -> a table per method."""
    from tools.plan.acceptance import decode_rounds, from_rounds, table_to_json

    rounds: dict[str, list[tuple[int, int]]] = {}
    for path in args.rounds:
        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        for r in decode_rounds(rows):
            if args.workload and r.get("workload", "") != args.workload:
                continue
            rounds.setdefault(r["method"], []).append((int(r["drafted"]), int(r["accepted"])))
    table = {m: from_rounds(rs) for m, rs in rounds.items()}
    Path(args.out).write_text(json.dumps(table_to_json(table), indent=1) + "\n")
    for m, a in table.items():
        print(f"{m}: {a.rounds} rounds, propose {a.propose_rate:.2f}, by position "
              f"{[round(r, 2) for r in a.position_rates]}")
    return 0


def cmd_roofline(args: argparse.Namespace) -> int:
    from tools.plan.profile import save_profile
    from tools.plan.roofline import roofline_profile

    profile = roofline_profile(args.gpu, args.model_config, args.draft_gpu,
                               args.draft_config, colocated=args.colocated)
    save_profile(profile, Path(args.out))
    print(f"{profile.name}: {profile.source} -> {args.out}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from tools.plan.validate import run_validation
    return run_validation(args)


def cmd_size(args: argparse.Namespace) -> int:
    from tools.plan.size import run_size
    return run_size(args)


def register_more(sub) -> None:
    c = sub.add_parser("calibrate", help="measure this host's verify, draft and hop costs")
    c.add_argument("--out", default="profile.json")
    c.add_argument("--name", default="cpu-host")
    c.add_argument("--model", default="", help="target (default: the shipped target)")
    c.add_argument("--draft-model", default="", help="draft (default: the shipped draft)")
    c.add_argument("--threads", type=int, default=1, help="torch threads (tandem up's: 1)")
    c.add_argument("--reps", type=int, default=5)
    c.set_defaults(func=cmd_calibrate)

    a = sub.add_parser("acceptance", help="recorded rounds -> acceptance table by method")
    a.add_argument("rounds", nargs="+", help="JSON lines of {method, drafted, accepted}")
    a.add_argument("--workload", default="", help="only rounds of this workload category")
    a.add_argument("--out", default="acceptance.json")
    a.set_defaults(func=cmd_acceptance)

    r = sub.add_parser("roofline", help="a device profile from data sheets and config.json")
    r.add_argument("--gpu", required=True, help="h100, h200, a100 or l4")
    r.add_argument("--model-config", required=True, help="the target's config.json (or a "
                   "built-in shape: llama-3.1-8b, llama-3.2-1b)")
    r.add_argument("--draft-gpu", default="", help="the draft pool's GPU (default: --gpu)")
    r.add_argument("--draft-config", default="llama-3.2-1b", help="the draft's config.json")
    r.add_argument("--colocated", action="store_true",
                   help="the draft runs on the verifier's GPU (an EAGLE head)")
    r.add_argument("--out", default="roofline.json")
    r.set_defaults(func=cmd_roofline)

    from tools.plan.validate import add_validate_flags
    v = sub.add_parser("validate", help="the local cluster against the simulation, per load "
                       "and method: a table and a plot")
    add_validate_flags(v)
    v.set_defaults(func=cmd_validate)

    from tools.plan.size import add_size_flags
    s = sub.add_parser("size", help="cheapest pod counts for a traffic and SLO; k per load; "
                       "a kustomize HPA patch")
    add_size_flags(s)
    s.set_defaults(func=cmd_size)
