"""Prompts the target writes itself (Magpie, Xu et al. 2024): given its chat template up to
the start of a user turn, an instruct model samples a user request from the distribution it was
tuned on. Those requests are far more varied than a template x subject grid, and closer to what
people ask it: a head trained on the answers to them agrees with the target on new chat, not
only inside the grid (docs/results/eagle_agreement.md).

Cached as JSON lines next to the data shards and extended batch by batch, so an interrupted run
resumes; the hand-written held-out prompts are never kept (their figure stays held out).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Protocol

from tandem.sampling_params import SamplingParams
from tools.distill.airgap_prompts import (
    MAX_IDLE_BATCHES,
    MAX_TOKENS,
    TEMPERATURE,
    TOP_P,
    draw_seed,
    finished,
    keep,
    key,
)
from tools.distill.corpus import Prompt

__all__ = ["MAX_IDLE_BATCHES", "query_prefix", "self_prompts", "turn_end_ids"]


_MARKER = "\x00MAGPIE\x00"


def _around_marker(tokenizer) -> tuple[str, str]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in text:
        raise ValueError("the target's chat template does not render the user's message")
    before, after = text.split(_MARKER, 1)
    return before, after


def query_prefix(tokenizer) -> list[int]:
    """The template's tokens up to the user's first word: system turn, then `user` opened."""
    return tokenizer(_around_marker(tokenizer)[0], add_special_tokens=False).input_ids


def turn_end_ids(tokenizer) -> list[int]:
    """What ends a user's request: the special token the template writes right after it
    (<|im_end|>, <|eot_id|>, [/INST] ...), and end of sequence."""
    after = tokenizer(_around_marker(tokenizer)[1], add_special_tokens=False).input_ids
    ids = [after[0]] if after and after[0] in set(tokenizer.all_special_ids) else []
    return list(dict.fromkeys(ids + ([tokenizer.eos_token_id]
                                     if tokenizer.eos_token_id is not None else [])))


def heldout_keys() -> set[str]:
    from tools.distill.acceptance import load_prompts

    return {key(p) for p in load_prompts(None)}


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 stop_token_ids: tuple[int, ...] = ()) -> list[list[int]]: ...


def self_prompts(gen: Generator, tokenizer, n: int, seed: int, path: Path, batch: int = 64,
                 deadline: float | None = None) -> list[Prompt]:
    """n distinct requests sampled from the target (`gen`, a LocalGenerator), cached (and
    resumed) in `path`; fewer if the deadline passes first."""
    have = [Prompt(**json.loads(x)) for x in path.read_text().splitlines()] \
        if path.exists() else []
    seen = heldout_keys() | {key(p.text) for p in have}
    prefix, idle = query_prefix(tokenizer), 0
    stop = tuple(turn_end_ids(tokenizer))
    if not stop:
        raise ValueError("the target's tokenizer names no token that ends a user's turn")
    start, at_start = time.perf_counter(), len(have)
    while len(have) < n and (deadline is None or time.time() < deadline):
        params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P,
                                seed=draw_seed(seed, len(have), idle, batch))
        outs = gen.generate([prefix] * batch, params, MAX_TOKENS, stop)
        new = [Prompt("chat", text, "self") for req in finished(outs, set(stop))
               if req is not None and keep(text := tokenizer.decode(req).strip(), seen)]
        with path.open("a") as f:  # whole lines only: a cut run loses one batch at most
            f.write("".join(json.dumps(p.__dict__) + "\n" for p in new))
        have += new
        idle = 0 if new else idle + 1
        if idle >= MAX_IDLE_BATCHES:
            raise ValueError(f"no usable request from the target in {idle} batches of {batch}"
                             " (none ended its turn within "
                             f"{MAX_TOKENS} tokens): use --prompt-mix chat with this target")
        rate = (len(have) - at_start) / max(time.perf_counter() - start, 1e-9)
        eta = max(n - len(have), 0) / max(rate, 1e-9)
        print(f"self prompts: {len(have)}/{n} ({len(new)}/{batch} kept this batch, "
              f"{rate:.1f}/s, ETA {eta / 60:.0f} min)", file=sys.stderr, flush=True)
    return have[:n]
