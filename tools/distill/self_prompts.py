"""Prompts the target writes itself (Magpie, Xu et al. 2024): given its chat template up to
the start of a user turn, an instruct model samples a user request from the distribution it was
tuned on. Those requests are far more varied than a template x subject grid, and closer to what
people ask it: a head trained on the answers to them agrees with the target on new chat, not
only inside the grid (docs/eagle_agreement.md).

Cached as JSON lines next to the data shards and extended batch by batch, so an interrupted run
resumes; the hand-written held-out prompts are never kept (their figure stays held out).
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Protocol

from tandem.sampling_params import SamplingParams
from tools.distill.corpus import Prompt

# Sampled as Magpie samples: the full distribution, so rare requests appear too.
TEMPERATURE = 1.0
TOP_P = 0.95
MAX_TOKENS = 128  # a request cut off here is dropped, not kept half-written
_MIN_WORDS = 3
MAX_IDLE_BATCHES = 4  # a target that never ends the user's turn is not an instruct model


def query_prefix(tokenizer) -> list[int]:
    """The template's tokens up to the user's first word: system turn, then `user` opened."""
    marker = "\x00MAGPIE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise ValueError("the target's chat template does not render the user's message")
    return tokenizer(text.split(marker)[0], add_special_tokens=False).input_ids


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def heldout_keys() -> set[str]:
    from tools.distill.acceptance import load_prompts

    return {_key(p) for p in load_prompts(None)}


def keep(text: str, seen: set[str]) -> bool:
    """A finished, non-trivial request not seen before (nor among the held-out prompts)."""
    k = _key(text)
    if len(k.split()) < _MIN_WORDS or k in seen:
        return False
    seen.add(k)
    return True


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 stop_token_ids: tuple[int, ...] = ()) -> list[list[int]]: ...


def self_prompts(gen: Generator, tokenizer, n: int, seed: int, path: Path, batch: int = 64,
                 deadline: float | None = None) -> list[Prompt]:
    """n distinct requests sampled from the target (`gen`, a LocalGenerator), cached (and
    resumed) in `path`; fewer if the deadline passes first."""
    have = [Prompt(**json.loads(x)) for x in path.read_text().splitlines()] \
        if path.exists() else []
    seen = heldout_keys() | {_key(p.text) for p in have}
    prefix, idle = query_prefix(tokenizer), 0
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop = tuple(t for t in (end, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0)
    start, at_start = time.perf_counter(), len(have)
    while len(have) < n and (deadline is None or time.time() < deadline):
        # Keyed by what the cache holds, so a resumed run draws new requests, not old ones.
        params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P,
                                seed=seed * 1_000_003 + len(have) * 1009 + idle * batch)
        outs = gen.generate([prefix] * batch, params, MAX_TOKENS, stop)
        new = [Prompt("chat", text, "self") for out in outs
               if out and out[-1] in stop
               and keep(text := tokenizer.decode(out[:-1]).strip(), seen)]
        with path.open("a") as f:  # whole lines only: a cut run loses one batch at most
            f.write("".join(json.dumps(p.__dict__) + "\n" for p in new))
        have += new
        idle = 0 if new else idle + 1
        if idle >= MAX_IDLE_BATCHES:
            raise ValueError(f"the target wrote no usable request in {idle} batches of {batch}"
                             " (none ended its turn within "
                             f"{MAX_TOKENS} tokens): use --prompt-mix chat with this target")
        rate = (len(have) - at_start) / max(time.perf_counter() - start, 1e-9)
        eta = max(n - len(have), 0) / max(rate, 1e-9)
        print(f"self prompts: {len(have)}/{n} ({len(new)}/{batch} kept this batch, "
              f"{rate:.1f}/s, ETA {eta / 60:.0f} min)", file=sys.stderr, flush=True)
    return have[:n]
