"""N-gram prompt lookup (PaddleNLP's inference_with_reference, HF's prompt_lookup_num_tokens).

No model: match the last n tokens of the sequence (n from max_ngram_size down to 1) against
earlier text (prompt and everything generated since), and propose the tokens that followed the
most recent earlier match. Works well when the output copies from the prompt (code edits,
summaries, RAG answers, quoting). Where the match is a single token and a copy ran up to the
token before it, the copy resumes past that token (resume_match: the model added a comma).
q is one-hot, so nothing but the token ids goes on the wire.
"""
from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from tandem.spec import DraftRequest, DraftResult, DraftToken, Method
from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS

_ITEM_BYTES = array("i").itemsize


def ngram_lookup(
    token_ids: Sequence[int], max_ngram_size: int, num_tokens: int, min_ngram_size: int = 1
) -> list[int]:
    """Up to num_tokens proposed continuations of token_ids ([] when nothing matches)."""
    return ngram_match(token_ids, max_ngram_size, num_tokens, min_ngram_size)[0]


# Below this many matched tokens a match is as likely chance as copy (chat's one- and
# two-token matches), and its drafts are estimated to fall away geometrically.
_COPY_MATCH = 3


def confidences(match_len: int, num_tokens: int) -> tuple[float, ...]:
    """Each drafted token's estimated chance that verification reaches it.

    A match of m tokens: the first drafted token with m / (m + 2). A match of at least 3 is
    a copy under way, and every draft token it gets right makes the next likelier (the copy
    then holds m + 1 tokens: Laplace's rule of succession), so the chance of reaching the
    j-th is m / (m + j + 1), heavy-tailed: a copy that has held 6 tokens reaches its 8th draft
    with 0.4, the 16th with 0.26 (measured on this target's greedy answers that copy the
    prompt, 2026-11-28: 0.69 and 0.64), where the geometric decay of shorter matches gave
    0.1 and 0.01. This is what carries k up fast on a run of acceptances (the match grows
    with each) and down at once on a miss (the next match is new and short). A one- or
    two-token match (m / (m + 2)) ** j: on chat such matches are mostly chance (measured: a
    one-token match's first draft is right 13% of the time). The verifier corrects the
    scale per session from what its rounds accept (Sequence.est.source_scale)."""
    if match_len < _COPY_MATCH:
        c = match_len / (match_len + 2)
        return tuple(c ** (j + 1) for j in range(num_tokens))
    return tuple(match_len / (match_len + j + 2) for j in range(num_tokens))


_MAX_MATCH = 32  # longest match measured for the confidence
# A copy resumed after one inserted token (resume_match) is right about this often at first
# (the categories workload's copy-heavy answers, greedy, simulated over their tokens: 12 of 41
# resumes), and then runs on as the copy did.
RESUME_FIRST = 0.3


def resume_confidences(match_len: int, num_tokens: int) -> tuple[float, ...]:
    """A resumed copy's reach (resume_match): RESUME_FIRST that the output went back to the
    copy, then the copy's own chances (confidences) for the tokens after."""
    return tuple(RESUME_FIRST * c for c in confidences(max(match_len, _COPY_MATCH),
                                                        num_tokens))


def ngram_match(
    token_ids: Sequence[int], max_ngram_size: int, num_tokens: int, min_ngram_size: int = 1
) -> tuple[list[int], int]:
    """(up to num_tokens proposed continuations, how many tokens the match runs back, at
    least the n-gram's size, at most 32); ([], 0) when nothing matches.

    The copy may run into text it is itself proposing (a match one period back in a repeating
    pattern): that continues the period, which is what the text so far predicts, and it is the
    same as the classic lookup whenever the match lies at least num_tokens back.
    """
    _check_sizes(max_ngram_size, min_ngram_size, num_tokens)
    tokens = list(token_ids)
    return _match(tokens, _pack(tokens), len(tokens), max_ngram_size, num_tokens,
                  min_ngram_size)


def _check_sizes(max_ngram_size: int, min_ngram_size: int, num_tokens: int) -> None:
    if max_ngram_size < 1 or min_ngram_size < 1 or num_tokens < 1:
        raise ValueError(
            f"max_ngram_size, min_ngram_size and num_tokens must be >= 1, got "
            f"{max_ngram_size}, {min_ngram_size}, {num_tokens}"
        )


def _pack(tokens: list[int]) -> bytes:
    # Search the ids as packed bytes: bytes.rfind runs in C, which keeps a lookup over a long
    # context (thousands of tokens, hundreds of sessions per step) off the critical path.
    return array("i", tokens).tobytes()


def _match(tokens: list[int], packed: bytes, length: int, max_ngram_size: int,
           num_tokens: int, min_ngram_size: int) -> tuple[list[int], int]:
    """ngram_match over the first `length` tokens (`packed`: the tokens as _pack gives them,
    so a lookup that ends one token early, resume_match's, packs nothing again)."""
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        start = _last_match(packed, length, n)
        if start is None:
            continue
        held = n  # how far back before the n-gram the match also holds
        while (held < _MAX_MATCH and start - 1 - (held - n) >= 0
               and tokens[start - 1 - (held - n)] == tokens[length - 1 - held]):
            held += 1
        out: list[int] = []
        for src in range(start + n, start + n + num_tokens):  # may read what it proposed
            out.append(tokens[src] if src < length else out[src - length])
        return out, held
    return [], 0


def resume_match(
    token_ids: Sequence[int], max_ngram_size: int, num_tokens: int, min_ngram_size: int = 1
) -> tuple[list[int], int]:
    """After one inserted token: the copy that ran up to the token before the last, continued
    from where the insertion interrupted it; ([], 0) unless that copy held at least 3 tokens.

    A model copying text often adds one token the source does not have (a comma in "Every
    morning, she"; a space or quote of its own) and then goes on with the source. The last
    n tokens then end in that token, which the source does not have after them: the n-gram
    match falls back to one token (the comma), which matches any earlier comma, and the copy
    found its way back only after a round or two of wrong drafts. In the categories workload's
    copy-heavy answers (simulated over their greedy tokens) resuming where one-token matches
    stood took 340 rounds to 329, a copy with four added commas 15 to 8.
    """
    _check_sizes(max_ngram_size, min_ngram_size, num_tokens)
    tokens = list(token_ids)
    return _resume(tokens, _pack(tokens), max_ngram_size, num_tokens, min_ngram_size)


def _resume(tokens: list[int], packed: bytes, max_ngram_size: int, num_tokens: int,
            min_ngram_size: int) -> tuple[list[int], int]:
    if len(tokens) < _COPY_MATCH + 2:
        return [], 0
    ids, held = _match(tokens, packed, len(tokens) - 1, max_ngram_size, num_tokens,
                       min(min_ngram_size, max_ngram_size))
    if held < max(_COPY_MATCH, min_ngram_size) or not ids or ids[0] == tokens[-1]:
        return [], 0
    return ids, held


def _last_match(packed: bytes, length: int, n: int) -> int | None:
    """Start of the most recent earlier occurrence of the n tokens before `length`, if any."""
    width = _ITEM_BYTES
    suffix = packed[(length - n) * width:length * width]
    end = (length - 1) * width  # an earlier match ends at the latest one token before the end
    while (pos := packed.rfind(suffix, 0, end)) >= 0:
        if pos % width == 0:
            return pos // width
        end = pos + len(suffix) - 1  # a hit straddling two ids: look further back
    return None


def propose_copy(
    token_ids: Sequence[int], max_ngram_size: int, num_tokens: int, min_ngram_size: int = 1
) -> tuple[list[int], int, tuple[float, ...]]:
    """(the n-gram match's continuation, how far back the match holds, its confidences);
    where that match is a single token (chance, or an insertion into a copy), the resumed copy
    instead when there is one (resume_match). The ids are packed once for both lookups."""
    _check_sizes(max_ngram_size, min_ngram_size, num_tokens)
    tokens = list(token_ids)
    packed = _pack(tokens)
    ids, size = _match(tokens, packed, len(tokens), max_ngram_size, num_tokens, min_ngram_size)
    if size <= 1:
        resumed, held = _resume(tokens, packed, max_ngram_size, num_tokens, min_ngram_size)
        if resumed:
            return resumed, held, resume_confidences(held, len(resumed))
    return ids, size, confidences(size, len(ids))


class NgramProposer:
    """Prompt lookup behind the Proposer interface; stateless, so release() does nothing."""

    method = Method.NGRAM

    def __init__(self, max_ngram_size: int = 3, max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS,
                 min_ngram_size: int = 1):
        if max_ngram_size < 1 or max_spec_tokens < 1 or min_ngram_size < 1:
            raise ValueError(
                f"max_ngram_size, min_ngram_size and max_spec_tokens must be >= 1, got "
                f"{max_ngram_size}, {min_ngram_size}, {max_spec_tokens}"
            )
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size  # vLLM's prompt_lookup_min
        self.max_spec_tokens = max_spec_tokens

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        results = []
        for req in requests:
            n = req.max_ngram_size or self.max_ngram_size
            k = min(req.max_tokens, self.max_spec_tokens)
            ids, _, scores = propose_copy(req.token_ids, n, k, min(self.min_ngram_size, n)) \
                if k > 0 else ([], 0, ())
            results.append(DraftResult([DraftToken(t) for t in ids], scores=scores))
        return results

    def release(self, session_key: Hashable) -> None:
        return None
