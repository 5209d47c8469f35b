"""An EAGLE head's learning curve: held-out agreement against the positions it has trained on.

Every `tandem distill --method eagle` run (a first run or a --resume) appends one point to its
card's `learning_curve` (tandem_eagle.json): the training positions processed so far (steps x
batch tokens, passes over the same data counted again), the distinct positions in its data,
and the held-out top-1 at draft steps 1 and 2 (the trainer's validation split), plus the
agreement on the hand-written held-out chat prompts when that was measured. The plot shows
what the next hour of training (or the next batch of data) is likely to return.

    python -m tools.distill.learning_curve [HEAD_DIR] [--out docs/img/eagle-learning-curve.png]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_HEAD = Path("draft_service/weights/smollm2-135m-eagle")
CARD = "tandem_eagle.json"


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


def plot(points: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    x = [p["train_positions"] / 1e6 for p in points]
    # A validation split belongs to its data's prompt set: one series per set, so a run on
    # new prompts does not read as a drop of the old split's figure.
    for mix in dict.fromkeys(p.get("prompt_mix", "chat") for p in points):
        for key, step, style in (("top1_step1", 1, "o-"), ("top1_step2", 2, "s--")):
            pts = [(xi, p[key]) for xi, p in zip(x, points)
                   if p.get(key) is not None and p.get("prompt_mix", "chat") == mix]
            if pts:
                ax.plot(*zip(*pts), style, label=f"validation split ({mix} prompts), "
                                                  f"draft step {step}")
    pts = [(xi, p["heldout_chat_top1"]) for xi, p in zip(x, points)
           if p.get("heldout_chat_top1") is not None]
    if pts:
        ax.plot(*zip(*pts), "D-", color="k", label="hand-written held-out chat, step 1")
    ax.set_xscale("log")
    ax.set_xlabel("training positions processed (millions, log scale)")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head", nargs="?", type=Path, default=DEFAULT_HEAD,
                    help=f"EAGLE head directory with a {CARD} (default: the shipped head)")
    ap.add_argument("--out", type=Path, default=Path("docs/img/eagle-learning-curve.png"))
    args = ap.parse_args(argv)
    card_path = args.head / CARD
    if not card_path.is_file():
        ap.error(f"{card_path} not found: not a Tandem EAGLE head directory")
    card = json.loads(card_path.read_text())
    points = card.get("learning_curve", [])
    if not points:
        ap.error(f"{card_path} has no learning_curve (trained before it was recorded)")
    plot(points, args.out, f"EAGLE head learning curve ({card['target']['name']})")
    for p in points:
        print(json.dumps(p))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
