"""The PNGs of the report (matplotlib, headless). Each takes the summary only."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nan0(x) -> float:
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else x


def speedup(s: dict, path: Path, labels: dict) -> Path:
    temps = sorted({k[2] for k in s["speedup"]})
    cats = []
    for row in s["throughput"].values():
        cats += [c for c in row["by_category"] if c not in cats]
    groups = cats + ["all"]
    fig, axes = plt.subplots(len(temps) or 1, 1, figsize=(12, 3.6 * max(1, len(temps))),
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, temp in zip(axes[:, 0], temps):
        # a fixed colour per method, so the panels read alike
        series = [(lab, colors[i % len(colors)], s["speedup"][(sy, me, temp)])
                  for i, ((sy, me), lab) in enumerate(labels.items())
                  if (sy, me, temp) in s["speedup"]]
        width = 0.8 / max(1, len(series))
        for i, (lab, color, sp) in enumerate(series):
            ys = [_nan0(sp["by_category"].get(g)) for g in cats] + [_nan0(sp["all"])]
            ax.bar([g + i * width - 0.4 + width / 2 for g in range(len(groups))], ys, width,
                   label=lab, color=color)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.8, color="red", lw=0.8, ls="--", label="target 1.8x (best method)")
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("decode tokens/s\nvs Tandem plain")
        ax.set_title(f"Speedup by method and prompt type, T={temp:g}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def concurrency(s: dict, path: Path) -> Path:
    """Tokens/s (left) and ITL p99 (right) against sessions, one line per method."""
    conc = s["concurrency"]  # by level, then method (summary.concurrency_table)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, method in enumerate(dict.fromkeys(c["method"] for c in conc)):
        rows = [c for c in conc if c["method"] == method]
        xs = [c["sessions"] for c in rows]
        style = (dict(color="black", lw=2) if method == "none"
                 else dict(color=colors[i % len(colors)]))
        ax.plot(xs, [c["total_tps"] for c in rows], "o-", label=method, **style)
        ax2.plot(xs, [c["itl_p99_ms"] for c in rows], "o-", label=method, **style)
    one = next((c["total_tps"] for c in conc if (c["sessions"], c["method"]) == (1, "none")),
               None)
    if one:
        ax.axhline(one * 8, ls=":", color="grey", label="target at 16 sessions: 8x none at 1")
    levels = sorted({c["sessions"] for c in conc})
    for a, what in ((ax, "total tokens/s"), (ax2, "inter-token latency p99 (ms)")):
        a.set_xscale("log", base=2)
        a.set_xticks(levels, [str(x) for x in levels])
        a.set_xlabel("concurrent sessions (greedy)")
        a.set_ylabel(what)
    ax2.set_ylim(bottom=0)
    ax.set_title("Tokens/s versus concurrency")
    ax2.set_title("ITL p99 versus concurrency")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def acceptance(s: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    longest = 1
    for (method, temp), v in sorted(s["speculation"].items(), key=lambda kv: str(kv[0])):
        pos = v["per_position"]
        longest = max(longest, len(pos))
        if pos:
            # NaN (a position no round reached) leaves a gap in the line
            ax.plot(range(1, len(pos) + 1), pos, "o-", label=f"{method} T={temp:g}")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | positions before accepted)")
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize=8)
    return _save(fig, path)


def breakdown(s: dict, path: Path, parts) -> Path:
    rows = [(f"{m} T={t:g}", v["breakdown"]) for (m, t), v in sorted(s["speculation"].items(),
                                                                      key=lambda kv: str(kv[0]))
            if v["breakdown"]]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.6 * max(1, len(rows))))
    left = [0.0] * len(rows)
    for key, name in parts:
        vals = [max(0.0, _nan0(b[key])) for _, b in rows]
        ax.barh(range(len(rows)), vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    for y, ((_, b), x) in enumerate(zip(rows, left)):
        ax.text(x, y, f" {b['gap_ms']:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("ms per round (mean; the first round, with the prefill, left out)")
    ax.set_title("Where a speculation round's time goes")
    ax.set_xlim(0, max(left + [1.0]) * 1.15)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def shapes(s: dict, path: Path) -> Path:
    """Tokens per round (left) and speedup over plain (right), chain beside tree per method."""
    rows = [r for r in s["shapes"] if r["shape"]]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["shape"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, what in ((axes[0], "tokens_per_round", "committed tokens per round"),
                          (axes[1], "speedup", "decode tokens/s vs plain (same phase)")):
        for i, shape in enumerate(("chain", "tree")):
            xs = [j + (i - 0.5) * 0.38 for j in range(len(methods))]
            ax.bar(xs, [_nan0(by.get((m, shape), {}).get(key)) for m in methods], 0.38,
                   label=shape)
            if key == "speedup":  # the verify-cost bound each bar falls short of
                ax.plot(xs, [by.get((m, shape), {}).get("bound", math.nan) for m in methods],
                        "k_", ms=22, mew=2, label="bound" if i == 0 else None)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(methods)), methods)
        ax.set_ylabel(what)
    axes[0].axhline(2.5, color="red", lw=0.8, ls="--", label="target 2.5 (tree)")
    axes[1].axhline(2.0, color="red", lw=0.8, ls="--", label="target 2.0x (best method)")
    axes[0].set_title("Tokens per round, chain vs tree (greedy)")
    axes[1].set_title("Speedup, chain vs tree (greedy)")
    for ax in axes:
        ax.legend(fontsize=8)
    return _save(fig, path)


def write_all(s: dict, out_dir: Path, names: dict, parts, labels: dict) -> list[Path]:
    out = [speedup(s, out_dir / names["speedup"], labels),
           concurrency(s, out_dir / names["concurrency"]),
           acceptance(s, out_dir / names["acceptance"]),
           breakdown(s, out_dir / names["breakdown"], parts)]
    if any(r["shape"] for r in s.get("shapes", [])):  # only when the phase ran
        out.append(shapes(s, out_dir / names["shapes"]))
    return out
