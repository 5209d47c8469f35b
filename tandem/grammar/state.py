"""One session's grammar: where its committed text stands, and the token masks of a round.

A round verifies drafts the grammar has not seen. `masks` walks the matcher through them
(a chain, or a tree by parents) to compute the allowed tokens at every verified position,
then rolls back: the matcher only ever advances by `commit`, with the tokens the verifier
committed. Drafts the grammar forbids get their parent's mask for the rows under them (those
rows are never used: the forbidden draft itself has probability 0, so it is rejected).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import llguidance

from tandem.errors import InvalidArgument

if TYPE_CHECKING:  # the gateway reads captures and needs no torch: masks import it
    import torch


class GrammarFailed(InvalidArgument):
    """A session's grammar broke mid-generation (llguidance hit one of its limits): the
    session ends with this error, not with text the grammar did not produce."""


def short_reason(message: str, lines: int = 1, limit: int = 300) -> str:
    """The head of an llguidance message, which goes on with a source excerpt (a compile's)
    or the grammar's state and the user's tokens (a matcher's): its first `lines` lines,
    joined, at most `limit` characters."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:lines])
    return text[:limit]


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self.words = mask_words(vocab_size)
        # The mask at the committed text, as check_start made it (admission's): the first
        # round's root row, which can take a hostile grammar 0.3 s, is not made twice.
        self._start: bytes | None = None

    def commit(self, tokens: list[int]) -> bool:
        """Advance by committed tokens; False (and the matcher in its error state) if the
        grammar forbids one (a resumed session's tokens from elsewhere)."""
        if tokens:  # the matcher moves on: admission's mask is no longer the start's
            self._start = None
        for t in tokens:
            if self.matcher.is_stopped():
                return t in self.eos_ids
            if not self.matcher.consume_token(t):
                return False
        return True

    @property
    def forced(self) -> list[int]:
        """Tokens the grammar allows alone from here (a key's closing quote, `": "`, ...)."""
        if self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()

    def check_start(self) -> None:
        """GrammarFailed if the mask at the committed text breaks llguidance's limits (a row
        too wide, a lexer out of expressions). Torch-free: the gateway's admission runs it."""
        self._check()
        self._start = self.matcher.compute_bitmask()
        self._check()

    def masks(self, drafts: list[int], parents: tuple[int, ...] | None = None) -> torch.Tensor:
        """[len(drafts) + 1, words] int32 bitmasks: row 0 at the committed text, row i + 1
        after drafts[i] and its ancestors (parents[i]: index among drafts, -1 = root;
        None = a chain). The matcher ends where it started."""
        import torch

        out = torch.zeros(len(drafts) + 1, self.words, dtype=torch.int32)
        self._fill(out, 0, at_start=True)
        paths: list[list[int] | None] = []
        cur: list[int] = []  # tokens consumed beyond the committed text
        for i, tok in enumerate(drafts):
            p = i - 1 if parents is None else parents[i]
            base = [] if p < 0 else paths[p]
            if base is None:  # under a forbidden draft
                paths.append(None)
                out[i + 1] = out[p + 1]
                continue
            cur = self._move(cur, base)
            if self.matcher.validate_tokens([tok]) == 1 and self.matcher.consume_token(tok):
                cur = [*base, tok]
                paths.append(cur)
                self._fill(out, i + 1)
            else:
                paths.append(None)
                out[i + 1] = out[p + 1]
        self._move(cur, [])
        return out

    def next_mask(self, drafts: list[int]) -> torch.Tensor:
        """[1, words]: the tokens allowed after the committed text and `drafts` (after the
        allowed part of them, should one be forbidden); a draft worker's next draft."""
        import torch

        n = self.matcher.validate_tokens(drafts) if drafts else 0
        if n:
            self.matcher.consume_tokens(drafts[:n])
        out = torch.zeros(1, self.words, dtype=torch.int32)
        self._fill(out, 0)
        if n:
            self.matcher.rollback(n)
        return out

    def copy_after(self, drafts: list[int]) -> GrammarState:
        """An independent copy advanced past `drafts` (the allowed part of them): a draft
        worker's tree walks it from another thread while the session's own one commits."""
        out = GrammarState(self.matcher.deep_copy(), self.vocab_size, self.eos_ids)
        n = out.matcher.validate_tokens(drafts) if drafts else 0
        if n:
            out.matcher.consume_tokens(drafts[:n])
        return out

    def mask_after(self, path: list[int]) -> torch.Tensor | None:
        """[1, words]: the tokens allowed after `path` (a tree node's tokens from here);
        None when the grammar forbids the path. The matcher ends where it started."""
        import torch

        n = self.matcher.validate_tokens(path) if path else 0
        if n < len(path):
            return None
        if n:
            self.matcher.consume_tokens(path)
        out = torch.zeros(1, self.words, dtype=torch.int32)
        self._fill(out, 0)
        if n:
            self.matcher.rollback(n)
        return out

    def _move(self, cur: list[int], target: list[int]) -> list[int]:
        """Roll back to the common prefix of `cur` and `target`, then consume the rest."""
        common = 0
        while common < min(len(cur), len(target)) and cur[common] == target[common]:
            common += 1
        if len(cur) > common:
            self.matcher.rollback(len(cur) - common)
        if len(target) > common:
            self.matcher.consume_tokens(target[common:])
        return target

    def _fill(self, out: torch.Tensor, row: int, at_start: bool = False) -> None:
        import torch

        self._check()
        v = out[row]
        if at_start and self._start is not None:
            raw = bytearray(self._start[:v.numel() * v.element_size()])
            v.view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
        else:
            self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        self._check()  # the mask may hit a limit itself (a row too wide, a lexer shared by
        # every copy of the grammar out of expressions): then it is empty
        if not bool(v.any()):
            for t in self.eos_ids:  # stopped, nothing more to say: it may only end
                v[t // 32] |= 1 << (t % 32)

    def _check(self) -> None:
        if self.matcher.is_error():  # past llguidance's limits (whose mask would be EOS
            # alone: a 200 with text the grammar never produced): the session cannot go on
            raise GrammarFailed(f"grammar: {short_reason(self.matcher.get_error())}")
