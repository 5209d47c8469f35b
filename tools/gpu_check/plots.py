"""At most three plots from gpu-check's results (matplotlib when installed; none otherwise):
the verify-cost curve, decode tokens/s, and the attention kernels' times."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _verify_cost(plt, res: dict, path: Path) -> bool:
    curves = res.get("curves", {})
    if not curves:
        return False
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (model, curve) in zip(axes[0], curves.items()):
        for batch, row in curve.items():
            qs = [int(q) for q in row]
            ax.plot(qs, [ms / row["1"] for ms in row.values()], marker="o", label=f"batch {batch}")
        ax.set(title=model, xlabel="new tokens per sequence (q)", ylabel="forward time / q=1")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _bars(plt, groups: dict[str, dict[str, float]], ylabel: str, path: Path) -> bool:
    """One group of bars per outer key, one bar per inner key."""
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    inner = sorted({k for g in groups.values() for k in g})
    width = 0.8 / max(len(inner), 1)
    for j, key in enumerate(inner):
        ax.bar([i + j * width for i in range(len(groups))],
               [g.get(key, 0) for g in groups.values()], width, label=key)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_plots(out: Path, phases: dict[str, dict]) -> list[str]:
    """File names of the plots written into out (empty without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []

    def res(name):
        return phases.get(name, {}).get("results", {})

    decode = {f"{m} b{b}": {"tokens/s": t} for m, row in res("decode").get("tokens_per_s",
                                                                            {}).items()
              for b, t in row.items()}
    attn = {layout: {k: v["ms"] for k, v in row.items() if isinstance(v, dict)}
            for layout, row in res("attention").get("layouts", {}).items()}
    made = []
    for name, write in (
            ("verify_cost.png", lambda p: _verify_cost(plt, res("verify_cost"), p)),
            ("decode_tokens_per_s.png", lambda p: _bars(plt, decode, "tokens/s", p)),
            ("attention_ms.png", lambda p: _bars(plt, attn, "ms per call", p))):
        try:
            if write(out / name):
                made.append(name)
        except Exception as exc:  # a plot never costs the report
            print(f"gpu-check: plot {name} skipped: {exc}")
    return made
