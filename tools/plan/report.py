"""The validation's comparison: simulate each measured cell, error per figure, a markdown
table, a JSON file and a plot (simulated against measured)."""
from __future__ import annotations

import json
from pathlib import Path

from tools.plan.runprofile import cell_speed, run_profile, slowed
from tools.plan.runprofile import with_prefills as _with_prefills  # noqa: F401 (its old name)

METRICS = ("throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")
TOLERANCE = {"throughput_tok_s": 0.15, "ttft_ms_p50": 0.15, "tpot_ms_p50": 0.15,
             "ttft_ms_p99": 0.25, "tpot_ms_p99": 0.25}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _rounds(out: Path) -> list[dict]:
    return _jsonl(out / "rounds.jsonl")


def acceptance_table(rounds: list[dict]):
    """Per method, and per (method, load) where the rounds say their load: the suffix cache
    and prefix cache grow as cells run, so a later cell's workload is not an earlier one's.
    Without each request's first round (acceptance.decode_rounds)."""
    from tools.plan.acceptance import decode_rounds, from_rounds
    by: dict = {}
    for r in decode_rounds(rounds):
        pair = (r["drafted"], r["accepted"])
        by.setdefault(r["method"], []).append(pair)
        if "load" in r:
            by.setdefault((r["method"], r["load"]), []).append(pair)
    return {m: from_rounds(rs) for m, rs in by.items()}


def compare(args, cells: dict, out: Path) -> list[dict]:
    from tools.plan.config import SimConfig
    from tools.plan.sim import simulate

    rounds = _rounds(out)
    loads = [k.split("|")[1] for k in cells if k.startswith("none|")]
    prefills = _jsonl(out / "prefill.jsonl")
    lengths = tuple(_json(out / "prompt_lengths.json") or
                    [p["prompt_tokens"] for p in prefills if p["prompt_tokens"]])
    table, over = acceptance_table(rounds), _json(out / "overhead.json")
    profile = run_profile(args.profile, rounds, loads, prefills, over)  # the closed loads'
    by_load = {ld: run_profile(args.profile, rounds, loads, prefills, over, load=ld)
               for ld in loads if not ld.startswith("c=")}  # open loads: their own level
    (out / "acceptance.json").write_text(json.dumps(
        {m if isinstance(m, str) else "|".join(m): {
            "position_rates": a.position_rates, "propose_rate": a.propose_rate,
            "rounds": a.rounds} for m, a in table.items()}, indent=1) + "\n")
    rows = []
    for key, meas in cells.items():
        method, load = key.split("|")
        c = int(load[2:]) if load.startswith("c=") else 0
        cfg = SimConfig(method=method, concurrency=c, rate=0.0 if c else args.rate,
                        requests=meas["requests"], max_tokens=args.max_tokens,
                        prompt_tokens=max(1, round(meas["prompt_tokens_mean"])),
                        prompt_lengths=lengths,
                        warm_prefixes=bool(lengths) and not meas.get("cold", False),
                        drafts=1, seed=args.seed)
        speed = cell_speed(rounds, method, load) if getattr(args, "cell_speed", False) else 1.0
        sim = simulate(cfg, slowed(by_load.get(load, profile), speed),
                       table.get((method, load)) or table.get(method))
        err = {m: (sim[m] - meas[m]) / meas[m] if meas[m] else 0.0 for m in METRICS}
        rows.append({"method": method, "load": load, "measured": meas, "device_speed": speed,
                     "simulated": {m: sim[m] for m in (*METRICS, "acceptance_length_mean")},
                     "error": err, "within": {m: abs(err[m]) <= TOLERANCE[m] for m in METRICS}})
    name = "validate-cell-speed.json" if getattr(args, "cell_speed", False) else "validate.json"
    (out / name).write_text(json.dumps(
        {"profile": profile.to_json(), "rows": rows,
         "open_load_profiles": {ld: p.to_json() for ld, p in by_load.items()}},
        indent=1) + "\n")
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| method | load | " + " | ".join(f"{m} meas / sim (err)" for m in METRICS) + " |"
    lines = [head, "|" + "---|" * (2 + len(METRICS))]
    for r in rows:
        cells = []
        for m in METRICS:
            mark = "" if r["within"][m] else " **miss**"
            cells.append(f"{r['measured'][m]:.1f} / {r['simulated'][m]:.1f} "
                         f"({r['error'][m]:+.0%}){mark}")
        lines.append(f"| {r['method']} | {r['load']} | " + " | ".join(cells) + " |")
    n = sum(len(METRICS) for _ in rows)
    ok = sum(sum(r["within"].values()) for r in rows)
    lines.append(f"\n{ok} of {n} cells within tolerance (15% throughput and p50s, 25% p99s).")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4))
    methods = sorted({r["method"] for r in rows})
    for ax, m in zip(axes, METRICS):
        for i, meth in enumerate(methods):
            pts = [(r["measured"][m], r["simulated"][m]) for r in rows if r["method"] == meth]
            ax.scatter(*zip(*pts), label=meth, color=f"C{i}")
        hi = max(max(r["measured"][m], r["simulated"][m]) for r in rows) * 1.1
        tol = TOLERANCE[m]
        ax.plot([0, hi], [0, hi], "k-", lw=0.8)
        ax.fill_between([0, hi], [0, hi * (1 - tol)], [0, hi * (1 + tol)], color="0.85")
        ax.set(title=m, xlabel="measured", ylabel="simulated", xlim=(0, hi), ylim=(0, hi))
    axes[0].legend(fontsize=8)
    fig.suptitle("tandem plan validate: simulation against the local cluster (band: tolerance)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(args, rows: list[dict], out: Path) -> None:
    md = markdown(rows)
    stem = "validate-cell-speed" if getattr(args, "cell_speed", False) else "validate"
    (out / f"{stem}.md").write_text(md + "\n")
    plot(rows, out / f"{stem}.png")
    print(md)
