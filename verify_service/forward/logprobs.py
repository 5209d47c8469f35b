"""The emitted tokens' target logprobs (OpenAI's `logprobs`): read from the round's own
logits, beside the verification and without changing it."""
from __future__ import annotations

import torch

from verify_service.forward.step import StepInput, TokenLogprob


def emitted_logprobs(inputs: list[StepInput], found,  # [batch] rejection.Verdict
                     logits: torch.Tensor | None):  # [sum(num_logits), vocab] raw, or None
    """Per input, a TokenLogprob for each token the round emits (accepted drafts, then the
    recovered or bonus token), or () when not asked for. A token at depth d was sampled from
    the row of its parent: the root's row 0, then row node + 1 along the accepted path."""
    out: list[tuple[TokenLogprob, ...]] = []
    if logits is None or all(s.logprobs is None for s in inputs):
        return [()] * len(inputs)
    at = 0  # the forward's logits rows: each input's num_logits, in order
    for s, v in zip(inputs, found):
        accepted, next_token, path = v.accepted, v.next_token, v.path
        first, at = at, at + s.num_logits
        if s.logprobs is None:
            out.append(())
            continue
        tokens = list(accepted) + ([] if next_token is None else [next_token])
        rows = [first] + [first + p + 1 for p in (path or [])]
        lp = logits[rows[:len(tokens)]].float().log_softmax(-1)  # [emitted, vocab]
        chosen = lp[torch.arange(len(tokens), device=lp.device),
                    torch.tensor(tokens, device=lp.device)].tolist()
        tops = [()] * len(tokens)
        if s.logprobs:
            v, i = lp.topk(s.logprobs, dim=-1)
            tops = [tuple(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
        out.append(tuple(TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)))
    return out
