"""The validation's comparison: simulate each measured cell, error per figure, a markdown
table, a JSON file and a plot (simulated against measured)."""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

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
    and prefix cache grow as cells run, so a later cell's workload is not an earlier one's."""
    from tools.plan.acceptance import from_rounds
    by: dict = {}
    for r in rounds:
        pair = (r["drafted"], r["accepted"])
        by.setdefault(r["method"], []).append(pair)
        if "load" in r:
            by.setdefault((r["method"], r["load"]), []).append(pair)
    return {m: from_rounds(rs) for m, rs in by.items()}


def _by_load(rounds: list[dict], loads: list[str]) -> dict[str, list[dict]]:
    """The method none's rounds by load: their "load" key, or (older files) the cells' order,
    every none cell having run the same requests and tokens (one round per token)."""
    none = [r for r in rounds if r["method"] == "none"]
    if all("load" in r for r in none):
        return {ld: [r for r in none if r["load"] == ld] for ld in loads}
    n = len(none) // max(1, len(loads))
    return {ld: none[i * n:(i + 1) * n] for i, ld in enumerate(loads)}


def _with_prefills(verify: dict[int, float], prefills: list[dict]) -> dict[int, float]:
    """The curve from 32 tokens up replaced by the warm-up's cold prefills (ms by prompt
    tokens, median per size, never falling with size), when there are some."""
    by: dict[int, list[float]] = {}
    for p in prefills:
        if p.get("verify_ms") and p["prompt_tokens"] >= 32:
            by.setdefault(p["prompt_tokens"], []).append(p["verify_ms"])
    if len(by) < 3:
        return verify
    small = {q: ms for q, ms in verify.items() if q < 32}
    out, top = dict(small), max(small.values(), default=0.0)
    for q in sorted(by):
        top = max(top, statistics.median(by[q]))
        out[q] = top
    # beyond the longest prompt: the least-squares slope over them all, not the last pair's
    pts = [(q, statistics.median(ms)) for q, ms in by.items()]
    mq, mm = statistics.mean(q for q, _ in pts), statistics.mean(m for _, m in pts)
    var = sum((q - mq) ** 2 for q, _ in pts) or 1.0
    slope = max(0.0, sum((q - mq) * (m - mm) for q, m in pts) / var)
    q_max = max(by)
    out[max(2048, 2 * q_max)] = top + slope * (max(2048, 2 * q_max) - q_max)
    return out


def run_profile(profile_name: str, rounds: list[dict], loads: list[str],
                prefills: list[dict] = (), overhead: dict | None = None):
    """The profile the comparison simulates with: the calibrated curve's SHAPE, its LEVEL and
    the batch's extra cost from the verifier's own steps during the run (the rounds'
    verify_ms of method none at 1 and b sessions: what StepCost does in the verifier), the
    median rejection_ms as the step's work after the forward. A host shared with other jobs
    swings too much between a calibration and a run for the calibration's level to hold."""
    from tools.plan.profile import interpolate, load_profile
    base, overhead = load_profile(profile_name), overhead or {}
    step = {ld: statistics.median(r["verify_ms"] for r in rs)
            for ld, rs in _by_load(rounds, loads).items() if rs}
    if "c=1" not in step:
        return base
    scale = step["c=1"] / interpolate(base.verify_ms, 1)
    verify = {q: ms * scale for q, ms in base.verify_ms.items()}
    extra = {1: 0.0}
    for ld, ms in step.items():
        if ld.startswith("c=") and ld != "c=1":
            b = int(ld[2:])
            extra[b] = max(0.0, ms - interpolate(verify, b))
    verify = _with_prefills(verify, prefills)
    rej = [r["rejection_ms"] for r in rounds if r.get("rejection_ms")]
    per_step = (statistics.median(rej) if rej else base.step_overhead_ms) + \
        (overhead.get("step_gap_ms") or 0.0)
    return dataclasses.replace(
        base, verify_ms=verify, batch_extra_ms=extra, seq_overhead_ms=0.0,
        step_overhead_ms=round(per_step, 3),
        gateway_ms=round(overhead.get("gateway_ms") or base.gateway_ms, 3),
        source=f"{base.source}; scaled x{scale:.2f} and batch extra {extra} from the run's "
               f"own none steps (verify_ms median by load: "
               f"{ {k: round(v, 1) for k, v in step.items()} }); overheads {overhead}")


def _cell_speed(rounds: list[dict], method: str, load: str) -> float:
    """How much slower the verifier's plain forwards ran in this cell than in the none cell of
    the same load (the lower quartile of their verify_ms, so that the prefill rounds among
    them do not count): the host's drift (other jobs; a draft worker on the same cores),
    which the cell's own rounds measure. 1.0 without such rounds."""
    def med(m):
        xs = [r["verify_ms"] for r in rounds
              if r["method"] == m and r.get("load") == load and r["drafted"] == 0]
        return statistics.quantiles(xs, n=4)[0] if len(xs) >= 4 else None
    mine, base = med(method), med("none")
    return mine / base if mine and base else 1.0


def _slowed(profile, speed: float):
    """The profile's device costs (forwards, batch extra, draft steps) times speed."""
    if speed == 1.0:
        return profile
    return dataclasses.replace(
        profile, verify_ms={q: ms * speed for q, ms in profile.verify_ms.items()},
        batch_extra_ms={b: ms * speed for b, ms in profile.batch_extra_ms.items()},
        draft_ms={b: ms * speed for b, ms in profile.draft_ms.items()})


def compare(args, cells: dict, out: Path) -> list[dict]:
    from tools.plan.config import SimConfig
    from tools.plan.sim import simulate

    rounds = _rounds(out)
    loads = [k.split("|")[1] for k in cells if k.startswith("none|")]
    prefills = _jsonl(out / "prefill.jsonl")
    lengths = tuple(_json(out / "prompt_lengths.json") or
                    [p["prompt_tokens"] for p in prefills if p["prompt_tokens"]])
    table, profile = acceptance_table(rounds), run_profile(args.profile, rounds, loads, prefills,
                                                            _json(out / "overhead.json"))
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
        speed = _cell_speed(rounds, method, load) if getattr(args, "cell_speed", False) else 1.0
        sim = simulate(cfg, _slowed(profile, speed),
                       table.get((method, load)) or table.get(method))
        err = {m: (sim[m] - meas[m]) / meas[m] if meas[m] else 0.0 for m in METRICS}
        rows.append({"method": method, "load": load, "measured": meas, "device_speed": speed,
                     "simulated": {m: sim[m] for m in (*METRICS, "acceptance_length_mean")},
                     "error": err, "within": {m: abs(err[m]) <= TOLERANCE[m] for m in METRICS}})
    name = "validate-cell-speed.json" if getattr(args, "cell_speed", False) else "validate.json"
    (out / name).write_text(json.dumps(
        {"profile": profile.to_json(), "rows": rows}, indent=1) + "\n")
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
