"""An EAGLE head's learning curve: held-out agreement against the positions it has trained on.

Every `tandem distill --method eagle` run (a first run or a --resume) appends one point to its
card's `learning_curve` (tandem_eagle.json): the training positions processed so far (steps x
batch tokens, passes over the same data counted again), the distinct positions in its data,
and the held-out top-1 at draft steps 1 and 2 (the trainer's validation split), plus the
agreement on the hand-written held-out chat prompts when that was measured. The plot shows
what the next hour of training (or the next batch of data) is likely to return.

    python -m tools.distill.learning_curve [HEAD_DIR ...]
        [--out docs/results/img/eagle-learning-curve.png]

Several head directories (an EAGLE-1 head's tandem_eagle.json, an EAGLE-3 head's
tandem_eagle3.json) share one plot, each series labelled with its head's format.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_HEAD = Path("draft_service/weights/smollm2-135m-eagle")
CARD = "tandem_eagle.json"
CARDS = (CARD, "tandem_eagle3.json")  # EAGLE-1 (Tandem's layout), EAGLE-3 (published)


def curve_point(stats: dict, batch_tokens: int, data_positions: int,
                prompt_mix: str = "chat") -> dict:
    """One run's point from the trainer's stats (tools.distill.eagle.train's result);
    `prompt_mix` names the prompt set its data and validation split came from."""
    point = {"train_positions": int(stats.get("steps", 0)) * batch_tokens,
             "data_positions": data_positions, "prompt_mix": prompt_mix,
             "top1_step1": stats.get("top1_step1"), "top1_step2": stats.get("top1_step2"),
             "train_wall_s": stats.get("train_wall_s")}
    chat = stats.get("heldout_chat") or {}
    if chat.get("top1_step1") is not None:
        point["heldout_chat_top1"] = chat["top1_step1"]
    return point


def extend(old_card: dict | None, point: dict) -> list[dict]:
    """The curve after this run: a resumed head's points, then this one."""
    return [*((old_card or {}).get("learning_curve", [])), point]


def plot(curves: list[tuple[str, list[dict]]], out: Path, title: str) -> None:
    """curves: (label, points) per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(10.5, 4.4))
    for n, (label, points) in enumerate(curves):
        _series(ax, f"{label}: " if len(curves) > 1 else "", points, f"C{3 * n}", f"C{3 * n + 1}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())  # plain numbers, not 2x10^0
    ax.xaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("training positions processed (millions, log scale)")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _series(ax, prefix: str, points: list[dict], *colors: str) -> None:
    x = [p["train_positions"] / 1e6 for p in points]
    # A validation split belongs to its data's prompt set: one series per set, so a run on
    # new prompts does not read as a drop of the old split's figure.
    for mix, color in zip(dict.fromkeys(p.get("prompt_mix", "chat") for p in points), colors):
        for key, step, style in (("top1_step1", 1, "o-"), ("top1_step2", 2, "s--")):
            pts = [(xi, p[key]) for xi, p in zip(x, points)
                   if p.get(key) is not None and p.get("prompt_mix", "chat") == mix]
            if pts:
                ax.plot(*zip(*pts), style, color=color,
                        label=f"{prefix}validation split ({mix} prompts), draft step {step}")
    pts = [(xi, p["heldout_chat_top1"]) for xi, p in zip(x, points)
           if p.get("heldout_chat_top1") is not None]
    if pts:
        ax.plot(*zip(*pts), "D-", color=colors[0] if prefix else "k",
                markeredgecolor="k", label=f"{prefix}hand-written held-out chat, step 1")


def _card(head: Path) -> dict | None:
    for name in CARDS:
        if (head / name).is_file():
            return json.loads((head / name).read_text())
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="*", type=Path, default=[DEFAULT_HEAD],
                    help=f"EAGLE head directories with a {' or '.join(CARDS)} "
                         "(default: the shipped head)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/img/eagle-learning-curve.png"))
    args = ap.parse_args(argv)
    curves = []
    for head in args.heads:
        card = _card(head)
        if card is None:
            ap.error(f"{head}: no {' or '.join(CARDS)}: not a Tandem EAGLE head directory")
        if not card.get("learning_curve"):
            ap.error(f"{head}: its card has no learning_curve (trained before it was recorded)")
        label = "EAGLE-3" if card.get("format", "").startswith("tandem-eagle3") else "EAGLE-1"
        curves.append((f"{label} ({head.name})", card["learning_curve"]))
        for p in card["learning_curve"]:
            print(json.dumps({"head": str(head), **p}))
    plot(curves, args.out, f"EAGLE head learning curve ({card['target']['name']})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
