"""`tandem plan size`'s outputs: size.md (tables), size.png (k and throughput by load) and a
kustomize patch of the HPAs in the metrics they scale on (deploy/k8s/base/hpa.yaml:
tandem_verifier_waiting_sessions, tandem_verifier_kv_cache_usage_ratio,
tandem_draft_queue_depth)."""
from __future__ import annotations

import math
from pathlib import Path


def _pick(result: dict, method: str) -> str:
    p = result.get(method)
    if not p:
        return f"| {method} | no configuration within the limits meets the SLO | | | | |"
    r = p["result"]
    usd = f"{p['usd_per_mtok']:.3f}" if p.get("usd_per_mtok") else "n/a"
    return (f"| {method} | {p['verifiers']} | {p['drafts']} | {r['ttft_ms_p99']:.0f} / "
            f"{r['tpot_ms_p99']:.1f} | {r['throughput_tok_s']:.0f} | ${p['cost_hr']:.2f} | "
            f"${usd} |")


def _hpa(name: str, v: int, metrics: list[tuple[str, str, str]]) -> str:
    """One HPA's bounds and Pods-metric targets: (metric, averageValue, comment) each. At
    least 2 pods, as the base: the PodDisruptionBudget keeps one while a node drains."""
    rows = "".join(f"""    - type: Pods
      pods:
        metric:
          name: {m}
        target:
          type: AverageValue
          averageValue: {value}   # {note}
""" for m, value, note in metrics)
    return f"""apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {name}
spec:
  minReplicas: {max(2, v)}   # sized: {v}
  maxReplicas: {2 * max(2, v)}
  metrics:
{rows}"""


def hpa_patch(args, result: dict) -> str:
    """minReplicas: the pods the traffic needs; maxReplicas: twice that (bursts); targets: the
    per-pod queue and KV figures the simulation saw at that size, with headroom, so the HPA
    adds a pod before the SLO is at risk."""
    spec, plain = result.get(args.method), result.get("none")
    if plain and (not spec or (plain.get("usd_per_mtok") or 0) < (spec.get("usd_per_mtok") or 0)):
        spec = plain  # speculation does not pay here: no draft pool
    if not spec:
        return "# no configuration meets the SLO: nothing to patch\n"
    r, v, d = spec["result"], spec["verifiers"], spec["drafts"]
    waiting = max(1, math.ceil(r["waiting_sessions_mean"] * 1.5))
    kv = min(900, max(500, round(r["kv_cache_usage_mean"] * 1000 * 1.25)))
    sized = "no speculation (cheaper here: scale tandem-draft to 0)" if spec is plain \
        else args.method
    doc = (f"# kustomize patch for deploy/k8s/overlays/{args.overlay} (SIMULATION: "
           f"{result['profile']['name']})\n# traffic {args.traffic_rate} req/s, prompt "
           f"{args.prompt_tokens} / answer {args.max_tokens} tokens, SLO p99 TTFT "
           f"{args.slo_ttft_ms:g} ms, p99 TPOT {args.slo_tpot_ms:g} ms,\n# method "
           f"{args.method}; sized for {sized}\n")
    doc += _hpa("tandem-verifier", v, [
        ("tandem_verifier_waiting_sessions", f'"{waiting}"',
         f"simulated mean {r['waiting_sessions_mean']:.2f} at {v} pods"),
        ("tandem_verifier_kv_cache_usage_ratio", f"{kv}m",
         f"simulated mean {r['kv_cache_usage_mean']:.2f}")])
    if d and spec is not plain and not result["profile"]["name"].endswith("colocated"):
        queue = max(1, math.ceil(r["draft_batch_mean"] * 1.5))
        doc += "---\n" + _hpa("tandem-draft", d, [
            ("tandem_draft_queue_depth", f'"{queue}"',
             f"simulated sessions per draft step {r['draft_batch_mean']:.2f}")])
    return doc


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["throughput_none"] for r in rows], "o-", label="none")
    a.plot(c, [r["throughput_spec"] for r in rows], "o-", label="speculation")
    a.set(xscale="log", xlabel="concurrent users", ylabel="tokens/s (one verifier)")
    a.legend()
    b.plot(c, [r["k_mean"] for r in rows], "o-")
    b.set(xscale="log", xlabel="concurrent users", ylabel="mean k per round (batch plan)")
    fig.suptitle("tandem plan size (simulation)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_size_report(args, profile, result: dict, out: Path) -> None:
    lines = [f"# tandem plan size (simulation, profile {profile.name})", "",
             f"Profile: {profile.source}.", "",
             f"Traffic {args.traffic_rate} req/s (Poisson), prompt {args.prompt_tokens}, answer "
             f"{args.max_tokens} tokens; SLO p99 TTFT <= {args.slo_ttft_ms:g} ms, p99 TPOT <= "
             f"{args.slo_tpot_ms:g} ms.", "",
             "| method | verifiers | drafts | p99 TTFT / TPOT ms | tok/s | $/h | $/M tok |",
             "|---|---|---|---|---|---|---|",
             _pick(result, "none"), _pick(result, args.method), "",
             "## k per load (one verifier)", "",
             "| users | mean k | k when on | rounds speculating | tok/s none | tok/s spec | "
             "speedup | TPOT p50 none / spec ms | accepted length |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["k_per_load"]:
        lines.append(f"| {r['concurrency']} | {r['k_mean']:.2f} | {r['k_mode_when_on']} | "
                     f"{r['speculating_rounds']:.0%} | {r['throughput_none']:.0f} | "
                     f"{r['throughput_spec']:.0f} | "
                     f"{r['throughput_spec'] / max(r['throughput_none'], 1e-9):.2f}x | "
                     f"{r['tpot_p50_none']:.1f} / {r['tpot_p50_spec']:.1f} | "
                     f"{r['acceptance_length_mean']:.2f} |")
    off = result["speculation_off_above_concurrency"]
    lines += ["", "Speculation stops paying at " + (f"{off} concurrent users" if off else
                                                      "no load tried") + " (throughput)."]
    (out / "size.md").write_text("\n".join(lines) + "\n")
    patch = out / "kustomize" / f"{args.overlay}-hpa-patch.yaml"
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(hpa_patch(args, result))
    _plot(result["k_per_load"], out / "size.png")
    print("\n".join(lines))
    print(f"\nwrote {out}/size.md, size.json, size.png and {patch}")
