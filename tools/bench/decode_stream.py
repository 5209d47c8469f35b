"""Incremental detokenisation: `tokenizers`' DecodeStream against the hand-written offsets.

Both detokenisers of gateway/text.py are fed the same token streams, a round at a time
(one token, and 1-8 tokens as speculative rounds append them), and compared on tokens per
second and on the text: every round's released text and the whole must be equal, and equal
to `decode` of all the ids. The TextStream the gateway uses (stop strings, hold-back) is
timed over each as well.

  flock /tmp/tandem-bench.lock .venv/bin/python -m tools.bench.decode_stream \
      [--models SmolLM2-135M-Instruct,gemma3-270m] [--reps 5] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import gateway.text as text_mod
from gateway.text import OffsetDetokenizer, StreamDetokenizer, TextStream

MULTIBYTE = ("café naïve façade 日本語のテキストです。 Ελληνικά Кириллица العربية हिन्दी "
             "emoji 🎉🚀👩‍💻🇫🇷 e\u0301 combining; math ∑∫√∞ ≠ ≤; CJK 中文字符 한국어 텍스트. ")
CODE = ('def f(x):\n    """doc"""\n    return {"a": [1, 2, 3], \'b\': x ** 2}  # ok\n\n'
        "for (int i = 0; i < n; ++i) { s += a[i]; }\n")


def streams(tok, seed: int) -> dict[str, list[int]]:
    """The token streams: prose and markdown (docs), multi-byte text, code, and random ids
    (byte tokens in any order: characters that never complete)."""
    root = Path(__file__).resolve().parents[2]
    prose = (root / "docs/reference/models.md").read_text()[:24000]
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    return {"prose": enc(prose), "multibyte": enc(MULTIBYTE * 40), "code": enc(CODE * 60),
            "random ids": [rng.choice(vocab) for _ in range(3000)]}


def rounds(ids: list[int], most: int, seed: int) -> list[list[int]]:
    """Split into rounds of 1..most tokens (seeded), as verification commits them."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        k = rng.randint(1, most)
        out.append(ids[i:i + k])
        i += k
    return out


def run_detok(make, chunks) -> tuple[list[str], float]:
    start = time.perf_counter()
    d = make()
    out = [d.push(c) for c in chunks]
    out.append(d.finish())
    return out, time.perf_counter() - start


def run_textstream(kind, tok, chunks) -> tuple[list[str], float]:
    """The gateway's TextStream over one detokeniser (a stop string that never occurs keeps
    the hold-back and the stop search on)."""
    saved = text_mod.detokenizer
    text_mod.detokenizer = kind
    try:
        start = time.perf_counter()
        ts = TextStream(tok, stop_strings=["\x00never\x00"])
        out = [ts.push(c) for c in chunks]
        out.append(ts.finish())
        return out, time.perf_counter() - start
    finally:
        text_mod.detokenizer = saved


def measure(tok, name: str, ids: list[int], most: int, reps: int) -> dict:
    chunks = rounds(ids, most, seed=most)
    backend = tok.backend_tokenizer
    arms = {
        "offsets": lambda: run_detok(lambda: OffsetDetokenizer(tok), chunks),
        "DecodeStream": lambda: run_detok(lambda: StreamDetokenizer(tok, backend), chunks),
        "TextStream/offsets": lambda: run_textstream(
            lambda t, s=True: OffsetDetokenizer(t, s), tok, chunks),
        "TextStream/DecodeStream": lambda: run_textstream(
            lambda t, s=True: StreamDetokenizer(t, t.backend_tokenizer, s), tok, chunks),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    outs = {}
    for _ in range(reps):  # interleaved, so load on the host hits every arm alike
        for arm, fn in arms.items():
            outs[arm], dt = fn()
            times[arm].append(dt)
    whole = tok.decode(ids, skip_special_tokens=True)
    return {"stream": name, "tokens": len(ids), "rounds": len(chunks), "max_round": most,
            "tok_per_s": {a: len(ids) / statistics.median(t) for a, t in times.items()},
            "same_rounds": outs["offsets"] == outs["DecodeStream"],
            "same_text": "".join(outs["offsets"]) == "".join(outs["DecodeStream"]),
            "equals_decode": {a: "".join(o) == whole for a, o in outs.items()},
            "textstream_same": outs["TextStream/offsets"] == outs["TextStream/DecodeStream"]}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from tandem.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,gemma3-270m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        tok = AutoTokenizer.from_pretrained(str(resolve_model(model).root))
        for name, ids in streams(tok, seed=0).items():
            for most in (1, 8):
                row = {"model": model, **measure(tok, name, ids, most, args.reps)}
                rows.append(row)
                r = row["tok_per_s"]
                print(f"{model:22} {name:10} rounds<={most}: offsets {r['offsets']:9.0f} "
                      f"DecodeStream {r['DecodeStream']:9.0f} tok/s "
                      f"({r['DecodeStream'] / r['offsets']:.2f}x); TextStream "
                      f"{r['TextStream/offsets']:8.0f} / {r['TextStream/DecodeStream']:8.0f} "
                      f"({r['TextStream/DecodeStream'] / r['TextStream/offsets']:.2f}x); "
                      f"same rounds {row['same_rounds']} text {row['same_text']} "
                      f"= decode {row['equals_decode']['DecodeStream']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_rounds"] and r["textstream_same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
