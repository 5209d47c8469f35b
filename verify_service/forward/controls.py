"""The sampling controls on a step's logits rows, each row over ITS OWN prefix: the
session's prompt, its committed output and the drafts before that row on its path (a chain:
drafts[:j]; a tree: the node's ancestors and itself), exactly what plain decoding would have
seen at that position. So presence, frequency and repetition penalties, bad words and
min_tokens stay exact under speculation, for chains and trees alike.

Order (vLLM's): allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition,
frequency and presence penalties. Temperature, min-p, top-k and top-p follow in
kernels/sampling.py; greedy takes the argmax of these rows. A row the bans would leave
without any token keeps the logits it had before the controls (plain decoding would
have nothing to sample there either), so one request cannot fault a step.
"""
from __future__ import annotations

import torch

from kernels import logits_processors as lp
from tandem.sampling_params import SamplingParams
from verify_service.forward.step import History, StepInput


def row_paths(s: StepInput) -> list[list[int]]:
    """The draft tokens before each of the session's logits rows, in row order: none for the
    root row, then each draft's path from the root down to it (a carried round's rows start
    at the first draft: its root row was the previous round's bonus row)."""
    parents = s.parents or tuple(range(-1, len(s.drafts) - 1))
    paths: list[list[int]] = []
    for j, parent in enumerate(parents):
        paths.append([*(paths[parent] if parent >= 0 else []), s.drafts[j].token_id])
    rows = [[], *paths]
    return rows[len(rows) - s.num_logits:]


def apply_controls(
    logits: torch.Tensor,  # [sum(num_logits), vocab] the step's (grammar-masked) rows
    inputs: list[StepInput],
) -> torch.Tensor:  # [sum(num_logits), vocab] a new tensor; the same when none has controls
    """Every controlled session's rows processed over their own prefixes."""
    if all(s.history is None or not s.num_logits for s in inputs):
        return logits
    out, at = logits.to(torch.float32, copy=True), 0
    for s in inputs:
        n = s.num_logits
        if s.history is not None and n:
            rows = out[at:at + n]
            rows.copy_(process_rows(rows, s.sampling, s.history, row_paths(s)))
        at += n
    return out


def process_rows(
    rows: torch.Tensor,  # [n, vocab] one session's logits rows
    params: SamplingParams,
    history: History,
    paths: list[list[int]],  # [n] the drafts before each row
) -> torch.Tensor:  # [n, vocab] float32
    """One session's rows through the controls, in vLLM's order."""
    before = rows.float()
    x = before.clone()
    vocab = x.shape[-1]
    if params.allowed_token_ids:
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[list(params.allowed_token_ids)] = True
        lp.allow_only(x, allowed)
    banned_rows, banned = _banned(params, history, paths)
    lp.ban(x, torch.tensor(banned_rows, dtype=torch.int64),
           torch.tensor(banned, dtype=torch.int64))
    if params.logit_bias:
        lp.add_bias(x, torch.tensor([t for t, _ in params.logit_bias]),
                    torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        x = _penalised(x, params, history, paths)
    empty = torch.isneginf(x).all(dim=-1)  # [n]
    if bool(empty.any()):
        x[empty] = before[empty]
    return x


def _banned(params: SamplingParams, history: History, paths: list[list[int]]
            ) -> tuple[list[int], list[int]]:
    """(row, token) pairs the bad words and min_tokens ban."""
    rows: list[int] = []
    tokens: list[int] = []
    longest = max((len(w) for w in params.bad_words), default=1) - 1
    tail = [*history.prompt, *history.output][-longest:] if longest else []
    stops = sorted(history.stop_token_ids)
    for r, path in enumerate(paths):
        context = [*tail, *path]
        for word in params.bad_words:
            head = list(word[:-1])
            if not head or context[len(context) - len(head):] == head:
                rows.append(r)
                tokens.append(word[-1])
        if len(history.output) + len(path) < params.min_tokens:
            rows += [r] * len(stops)
            tokens += stops
    return rows, tokens


def _penalised(
    x: torch.Tensor,  # [n, vocab] float32
    params: SamplingParams,
    history: History,
    paths: list[list[int]],  # [n]
) -> torch.Tensor:  # [n, vocab] float32
    """The penalties over each row's prompt and output (committed output + its path)."""
    n, vocab = x.shape
    dev = x.device

    def bincount(ids) -> torch.Tensor:  # [vocab] int64
        return torch.bincount(torch.tensor(ids, dtype=torch.int64, device=dev),
                              minlength=vocab)

    counts = bincount(history.output).expand(n, vocab).clone()  # [n, vocab]
    steps = [(r, t) for r, path in enumerate(paths) for t in path]
    if steps:
        r_idx, t_idx = torch.tensor(steps, dtype=torch.int64, device=dev).T
        counts.index_put_((r_idx, t_idx), torch.ones_like(r_idx), accumulate=True)
    prompt = (bincount(history.prompt) > 0).expand(n, vocab)

    def per_row(v: float) -> torch.Tensor:  # [n]
        return torch.full((n,), float(v), dtype=torch.float32, device=dev)

    return lp.apply_penalties(x, prompt, counts, per_row(params.presence_penalty),
                              per_row(params.frequency_penalty),
                              per_row(params.repetition_penalty))
