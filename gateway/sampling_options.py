"""The sampling controls of a request (OpenAI's penalties and logit_bias, vLLM's extras) and
the SamplingParams they become. The verifier applies them (tandem.sampling_params); the
gateway checks them against the tokenizer, names a bad field in its 400, and turns bad_words
into token-id sequences the way vLLM does."""
from __future__ import annotations

import hashlib
from typing import Annotated, Any

from pydantic import BaseModel, Field

from gateway.errors import bad_request
from gateway.logprobs import requested as requested_logprobs
from tandem.sampling_params import SamplingParams

# The verifier's bounds (tandem.sampling_params), so the 400 names the field here.
_MAX_LOGIT_BIAS_ENTRIES = 300
_MAX_BAD_WORDS = 64
_MAX_BAD_WORD_CHARS = 256
MAX_CHOICES = 16  # n and best_of
_SEED_MASK = 2**63 - 1

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class SamplingFields(BaseModel):
    """Mixed into GenerationRequest: the controls beyond temperature, top_k, top_p, seed."""

    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None


def choices(req: Any) -> tuple[int, int]:
    """(n, how many to generate): best_of >= n generates best_of and keeps the n best."""
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise bad_request(f"best_of: must be >= n ({n}), got {best_of}", param="best_of")
    if best_of > n and req.stream:
        raise bad_request("best_of: a best_of above n cannot be streamed (the best are known "
                          "only at the end)", param="best_of")
    return n, best_of


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's for choice 0 (so n=1 and choice 0 agree), else
    one derived from (seed, index); None stays unseeded."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _SEED_MASK


def sampling_fields(req: Any, tokenizer: Any, max_new_tokens: int) -> dict:
    """The GenerationPlan fields these controls decide: sampling, n, best_of, logprobs."""
    n, best_of = choices(req)
    sampling = sampling_params(req, tokenizer)
    if sampling.min_tokens > max_new_tokens:
        raise bad_request(f"min_tokens: {sampling.min_tokens} is more than the "
                          f"{max_new_tokens} tokens to generate", param="min_tokens")
    logprobs = requested_logprobs(req)
    if logprobs is None and best_of > n:
        logprobs = 0  # best_of ranks the choices by their tokens' logprobs: not shown
    return {"sampling": sampling, "n": n, "best_of": best_of, "logprobs": logprobs}


def sampling_params(req: Any, tokenizer: Any) -> SamplingParams:
    """The request's SamplingParams; 400 naming the field for what pydantic cannot check."""
    vocab = len(tokenizer)
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0, min_tokens=req.min_tokens or 0,
            logit_bias=_logit_bias(req.logit_bias, vocab),
            allowed_token_ids=_allowed(req.allowed_token_ids, vocab),
            bad_words=bad_words_ids(req.bad_words, tokenizer))
    except ValueError as exc:  # the verifier's own checks: a safety net behind the above
        raise bad_request(str(exc)) from None


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > _MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias: at most {_MAX_LOGIT_BIAS_ENTRIES} entries, got "
                          f"{len(bias)}", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.strip().isdigit() else -1
        if not 0 <= token < vocab:
            raise bad_request(f"logit_bias: keys are token ids in [0, {vocab}), got {key!r}",
                              param="logit_bias")
        if token in out:
            raise bad_request(f"logit_bias: token id {token} given twice", param="logit_bias")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _allowed(ids: list[int] | None, vocab: int) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not ids:
        raise bad_request("allowed_token_ids: must not be empty (leave it out to allow all)",
                          param="allowed_token_ids")
    if any(t >= vocab for t in ids):
        raise bad_request(f"allowed_token_ids: ids must be < {vocab}", param="allowed_token_ids")
    return tuple(dict.fromkeys(ids))


def bad_words_ids(words: list[str] | None, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word as it starts the text and, where that
    spells a different first token of the same length, after a space (mid-text)."""
    if not words:
        return ()
    if len(words) > _MAX_BAD_WORDS or any(len(w) > _MAX_BAD_WORD_CHARS for w in words):
        raise bad_request(f"bad_words: at most {_MAX_BAD_WORDS} words of at most "
                          f"{_MAX_BAD_WORD_CHARS} characters", param="bad_words")
    out: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words: words must not be empty", param="bad_words")
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(dict.fromkeys(out))
