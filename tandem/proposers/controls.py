"""The session's sampling controls on a draft model's own logits (issue 48), so its q looks
like the penalised target's and its drafts are accepted as often as without controls.

Each row is the next token after its request's token_ids (prompt + committed + drafts): the
same prefix the verifier processes that position over (verify_service/forward/controls.py),
in vLLM's order: allowed_token_ids, bad_words, logit_bias, then the repetition, frequency and
presence penalties (min_p follows with the temperature). min_tokens is left out: the draft
worker does not know the session's stop ids. Lossless whatever is applied here: the drafts
are sampled from the q that is sent, and the verifier's rejection uses that q.
"""
from __future__ import annotations

import torch

from kernels import logits_processors as lp
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest


def wants_controls(s: SamplingParams) -> bool:
    return bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0
                or s.logit_bias or s.allowed_token_ids or s.bad_words)


def apply_draft_controls(
    logits: torch.Tensor,  # [rows, vocab] one row per request
    batch: list[DraftRequest],
) -> torch.Tensor:  # [rows, vocab] float32 (the same tensor when no request has controls)
    if not any(wants_controls(r.sampling) for r in batch):
        return logits
    out = logits.float().clone()
    for i, req in enumerate(batch):
        if wants_controls(req.sampling):
            out[i] = _one_row(out[i:i + 1], req)[0]
    return out


def _one_row(
    row: torch.Tensor,  # [1, vocab] float32
    req: DraftRequest,
) -> torch.Tensor:  # [1, vocab] float32
    s, vocab = req.sampling, row.shape[-1]
    x = row.clone()
    if s.allowed_token_ids:
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[list(s.allowed_token_ids)] = True
        lp.allow_only(x, allowed)
    tail = req.token_ids
    banned = [w[-1] for w in s.bad_words
              if len(w) == 1 or list(tail[len(tail) - len(w) + 1:]) == list(w[:-1])]
    lp.ban(x, torch.zeros(len(banned), dtype=torch.int64), torch.tensor(banned, dtype=torch.int64))
    if s.logit_bias:
        lp.add_bias(x, torch.tensor([t for t, _ in s.logit_bias]),
                    torch.tensor([b for _, b in s.logit_bias], dtype=torch.float32))
    if s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0:
        start = min(req.prompt_len, len(req.token_ids))
        prompt = torch.zeros(1, vocab, dtype=torch.bool)
        prompt[0, list(req.token_ids[:start])] = True
        counts = torch.bincount(torch.tensor(req.token_ids[start:], dtype=torch.int64),
                                minlength=vocab)[None, :vocab]

        def one(v: float) -> torch.Tensor:
            return torch.tensor([float(v)], dtype=torch.float32)

        x = lp.apply_penalties(x, prompt, counts, one(s.presence_penalty),
                               one(s.frequency_penalty), one(s.repetition_penalty))
    if bool(torch.isneginf(x).all()):
        return row  # nothing left: the draft's q as it was (the verifier does likewise)
    return x
