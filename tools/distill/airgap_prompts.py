"""Requests the target writes itself (Magpie), sampled where the air-gapped script runs: a
bundle made with `--mix self` carries the template's prefix up to the user's first word
instead of prompts, and the script samples the requests with transformers before answering
them. Also what tandem's own `--prompt-mix self` keeps (tools/distill/self_prompts.py).

Stand-alone like the other airgap_*.py files: torch, transformers and the standard library.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

TEMPERATURE = 1.0  # the full distribution (Magpie's), so rare requests appear too
TOP_P = 0.95
MAX_TOKENS = 128  # a request cut off here is dropped, not kept half-written
MIN_WORDS = 3
MAX_IDLE_BATCHES = 4  # a target that never ends the user's turn is not an instruct model
PROMPT_SHARE = 0.4  # of the air-gapped run's generation time, at most


def key(text: str) -> str:
    """What makes two requests the same one (case, spacing and punctuation aside)."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def keep(text: str, seen: set[str]) -> bool:
    """A finished, non-trivial request not seen before (`seen` holds the held-out ones)."""
    k = key(text)
    if len(k.split()) < MIN_WORDS or k in seen:
        return False
    seen.add(k)
    return True


def draw_seed(seed: int, have: int, idle: int, batch: int) -> int:
    """A batch's seed, keyed by the requests cached so far: a resumed run draws new ones."""
    return seed * 1_000_003 + have * 1009 + idle * batch


def finished(rows: list[list[int]], stop: set[int]) -> list[list[int] | None]:
    """Each row up to its first stop token, or None where no stop token came (cut off)."""
    out = []
    for row in rows:
        cut = next((i for i, t in enumerate(row) if t in stop), None)
        out.append(None if cut is None else row[:cut])
    return out


def sample_requests(model, tokenizer, spec: dict, out: Path, budget_s: float, log) -> list[dict]:
    """spec["self_prompts"]'s count of requests in OUT/self_prompts.jsonl (resumed), each as
    {"split", "text", "ids"} with ids the chat-templated request; fewer if the budget ends."""
    sp = spec["self_prompts"]
    path = out / "self_prompts.jsonl"
    have = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    seen = set(sp["heldout_keys"]) | {key(p["text"]) for p in have}
    stop, batch, t0, idle = set(sp["stop_ids"]), sp["batch"], time.perf_counter(), 0
    prefix = torch.tensor([sp["prefix"]] * batch, device=model.device)
    while len(have) < sp["count"] and time.perf_counter() - t0 < budget_s:
        torch.manual_seed(draw_seed(sp["seed"], len(have), idle, batch))
        rows = model.generate(input_ids=prefix, attention_mask=torch.ones_like(prefix),
                              do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                              max_new_tokens=MAX_TOKENS, pad_token_id=spec["pad_id"],
                              eos_token_id=sorted(stop))[:, prefix.shape[1]:].tolist()
        new = []
        for req in finished(rows, stop):
            text = None if req is None else tokenizer.decode(req).strip()
            if text is not None and keep(text, seen):
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
                split = "val" if (len(have) + len(new)) % sp["val_every"] == 0 else "train"
                new.append({"split": split, "text": text, "ids": list(ids)[-sp["max_ids"]:]})
        with path.open("a") as f:  # whole lines only: a cut run loses one batch at most
            f.write("".join(json.dumps(p) + "\n" for p in new))
        have += new
        idle = 0 if new else idle + 1
        if idle >= MAX_IDLE_BATCHES:
            raise ValueError(f"no usable request from the target in {idle} batches of "
                             f"{batch}: bundle with --mix chat for this target")
        log(f"self prompts: {len(have)}/{sp['count']} ({len(new)}/{batch} kept this batch)")
    if not have:
        raise ValueError(f"no usable request from the target in {budget_s:.0f} s: give it "
                         "more --minutes, or bundle with --mix chat")
    return have[:sp["count"]]


def requests_for_run(model, inp: Path, spec: dict, out: Path, gen_budget_s: float,
                     clock: dict, log) -> list[dict]:
    """The run's prompts when the bundle asks for self-written ones: at most PROMPT_SHARE of
    the generation budget samples them (over reruns, in clock["prompt_s"]), the rest answers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(inp))
    t0 = time.perf_counter()
    budget = PROMPT_SHARE * gen_budget_s - clock.get("prompt_s", 0.0)
    try:
        return sample_requests(model, tokenizer, spec, out, budget, log)
    finally:
        spent = time.perf_counter() - t0
        clock["prompt_s"] = clock.get("prompt_s", 0.0) + spent
        clock["gen_s"] += spent
