"""OpenAI `logprobs` objects from the verifier's per-token log-probabilities.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`; completions
(the legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}`. The values are the target's raw distribution (log-softmax of its logits,
before temperature, top-k and top-p: vLLM's default), the same with speculation on or off.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.errors import bad_request

MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the verifier enforces the same
_FLOOR = -9999.0  # JSON has no -inf: a token the target gives probability 0 (as vLLM does)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob and its position's most likely tokens (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def requested(req) -> int | None:
    """How many top alternatives the request wants per token, or None for no logprobs.
    Chat: `logprobs: true` plus `top_logprobs`; completions: `logprobs: N`."""
    if hasattr(req, "top_logprobs"):  # chat
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


class LogprobsFormatter:
    """Formats entries for one response; completions' text_offset runs across chunks."""

    def __init__(self, chat: bool, decode: Callable[[int], str]):
        self.chat, self._decode, self._offset = chat, decode, 0

    def format(self, entries: Sequence[TokenLogprobs]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: Sequence[TokenLogprobs]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            token = self._decode(token_id)
            return {"token": token, "logprob": _finite(logprob),
                    "bytes": list(token.encode("utf-8"))}

        return {"content": [{**one(e.token_id, e.logprob),
                             "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def _completion(self, entries: Sequence[TokenLogprobs]) -> dict:
        tokens = [self._decode(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self._decode(t): _finite(lp) for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}
