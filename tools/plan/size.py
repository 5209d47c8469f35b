"""`tandem plan size`: what an operator asks, answered by simulation. For a target, draft,
GPU kinds, traffic and SLO (p99 TTFT and TPOT): the cheapest verifier and draft pod counts
with and without speculation, speedup and $ per million tokens; k per load and the load
above which speculation should be off; the HPA bounds and targets as a kustomize patch, in
the metrics deploy/k8s/base/hpa.yaml scales on."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools.plan.config import METHODS, SimConfig


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_size_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="h100", help="the verifiers' GPU (roofline)")
    p.add_argument("--draft-gpu", default="l4", help="the draft pool's GPU (roofline)")
    p.add_argument("--model-config", default="llama-3.1-8b", help="target config.json")
    p.add_argument("--draft-config", default="llama-3.2-1b", help="draft config.json")
    p.add_argument("--method", default="draft_model", choices=METHODS[1:])
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="the requests' k cap (0: the verifiers' 16)")
    p.add_argument("--colocated", action="store_true",
                   help="drafts on the verifiers' GPUs (EAGLE heads): no draft pods")
    p.add_argument("--profile", default="", help="a profile JSON instead of the roofline")
    p.add_argument("--acceptance", default="", help="acceptance table JSON")
    p.add_argument("--traffic-rate", type=float, default=10.0, help="requests/s to serve")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=300, help="requests per simulation")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="p99 TTFT")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="p99 TPOT")
    p.add_argument("--max-verifiers", type=int, default=8)
    p.add_argument("--max-drafts", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--loads", type=_ints, default=(1, 2, 4, 8, 16, 32, 64),
                   help="concurrent users for the k-per-load table (one verifier)")
    p.add_argument("--overlay", default="prod-gpu", help="the overlay the patch is for")
    p.add_argument("--out", default="plan-size")


def _profile(args):
    from tools.plan.profile import load_profile
    from tools.plan.roofline import roofline_profile
    if args.profile:
        return load_profile(args.profile)
    return roofline_profile(args.gpu, args.model_config, args.draft_gpu, args.draft_config,
                            colocated=args.colocated)


def _sim(args, profile, acc, method: str, **load) -> dict:
    from tools.plan.sim import simulate
    base = dict(method=method, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                requests=args.requests, max_num_seqs=args.max_num_seqs, drafts=0,
                num_speculative_tokens=args.num_speculative_tokens if method != "none" else 0)
    return simulate(SimConfig(**{**base, **load}), profile, acc if method != "none" else None)


def _meets(r: dict, args) -> bool:
    return r["ttft_ms_p99"] <= args.slo_ttft_ms and r["tpot_ms_p99"] <= args.slo_tpot_ms


def _cost_hr(profile, v: int, d: int) -> float:
    return v * profile.price_verifier_hr + d * profile.price_draft_hr


def cheapest(args, profile, acc, method: str) -> dict | None:
    """The cheapest (verifiers, drafts) meeting the SLO at the traffic rate, or None."""
    linked = method in ("draft_model", "eagle")
    best = None
    for v in range(1, args.max_verifiers + 1):
        for d in (range(v if profile.colocated_draft else 1, args.max_drafts + 1)
                  if linked else (0,)):
            if best and _cost_hr(profile, v, d) >= best["cost_hr"]:
                break
            r = _sim(args, profile, acc, method, rate=args.traffic_rate, verifiers=v, drafts=d)
            if _meets(r, args):
                best = {"verifiers": v, "drafts": d, "cost_hr": _cost_hr(profile, v, d),
                        "result": r}
                break
            if profile.colocated_draft:
                break  # one draft process per verifier GPU
    if best:
        tok_hr = best["result"]["throughput_tok_s"] * 3600
        best["usd_per_mtok"] = best["cost_hr"] / tok_hr * 1e6 if tok_hr else None
    return best


def k_per_load(args, profile, acc) -> list[dict]:
    """One verifier (and its share of drafts) at each concurrency: speculation's k and gain."""
    rows = []
    for c in args.loads:
        plain = _sim(args, profile, acc, "none", concurrency=c, requests=max(2 * c, 16))
        spec = _sim(args, profile, acc, args.method, concurrency=c, requests=max(2 * c, 16),
                    drafts=1)
        hist = spec["k_histogram"]
        decode = {k: n for k, n in hist.items() if k > 0}
        rows.append({"concurrency": c, "k_mean": (sum(k * n for k, n in hist.items())
                                                  / max(1, sum(hist.values()))),
                     "k_mode_when_on": max(decode, key=decode.get) if decode else 0,
                     "speculating_rounds": sum(decode.values()) / max(1, sum(hist.values())),
                     "throughput_none": plain["throughput_tok_s"],
                     "throughput_spec": spec["throughput_tok_s"],
                     "tpot_p50_none": plain["tpot_ms_p50"], "tpot_p50_spec": spec["tpot_ms_p50"],
                     "acceptance_length_mean": spec["acceptance_length_mean"]})
    return rows


def off_above(rows: list[dict]) -> int | None:
    """The lowest load at which speculation no longer pays in throughput (None: it always
    does within the loads tried)."""
    for r in rows:
        if r["throughput_spec"] < r["throughput_none"] * 1.02:
            return r["concurrency"]
    return None


def run_size(args) -> int:
    from tools.plan.cli import load_acceptance
    from tools.plan.size_report import write_size_report

    profile = _profile(args)
    acc = load_acceptance(args.acceptance, args.method)
    plain, spec = cheapest(args, profile, acc, "none"), cheapest(args, profile, acc, args.method)
    rows = k_per_load(args, profile, acc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"label": "simulation", "profile": {"name": profile.name, "source": profile.source},
              "args": {k: v for k, v in vars(args).items() if k != "func"},
              "none": plain, args.method: spec, "k_per_load": rows,
              "speculation_off_above_concurrency": off_above(rows)}
    (out / "size.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    write_size_report(args, profile, result, out)
    return 0
