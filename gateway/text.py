"""Incremental detokenisation with stop strings: what the client sees of committed tokens.

Tokens arrive a round at a time; text is released only once it can no longer change (a
multi-byte character split across tokens, or a possible stop string straddling rounds).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    """Committed token ids in, client-visible text out.

    Detokenizes incrementally (vLLM's prefix/read offsets): a token that ends inside a
    multi-byte character decodes to U+FFFD, so its text is held until the character
    completes. Holds back len(longest stop string) - 1 characters so a stop string split
    across rounds is never half shown; text from a stop string (or stop token) on is dropped.
    """

    def __init__(self, tokenizer: Decoder, stop_strings: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), *, include_stop: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        # include_stop (vLLM's include_stop_str_in_output): the stop string, or the stop
        # token's text, stays in the text; min_tokens: no stop counts before that many tokens.
        self._options = (include_stop, skip_special_tokens, min_tokens)
        self._include, self._skip_special, self._min_tokens = self._options
        self._search_from = -1  # where stop strings may start, once min_tokens are out
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self._stops = tuple(stop_strings)
        self._stop_ids = frozenset(stop_token_ids)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # visible text so far (emitted and held back)
        self._emitted = 0
        self.stopped = False  # a stop string or stop token ended the text
        # Tokens the output used: up to the one completing a stop string, or the stop token
        # itself; tokens committed after it in the same round are not the client's (usage).
        self.num_tokens = 0
        self._done = False  # the text is final: nothing more is ever shown

    def fresh(self) -> TextStream:
        """A new stream with the same settings (one per choice of an n > 1 request)."""
        include, skip, min_tokens = self._options
        return TextStream(self._tok, self._stops, tuple(self._stop_ids), include_stop=include,
                          skip_special_tokens=skip, min_tokens=min_tokens)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that may be shown now."""
        if self._done:
            return ""
        for t in token_ids:
            self.num_tokens += 1
            if t in self._stop_ids and self.num_tokens >= self._min_tokens:
                self.stopped = True  # the stop/eos token is shown only with include_stop
                if self._include:
                    self._ids.append(t)
                break
            self._ids.append(t)
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        if self.stopped:
            return self.finish()
        return self._release(final=False)

    def finish(self) -> str:
        """Generation ended: flush whatever is left (even an incomplete character)."""
        if self._done:
            return ""
        if self._read < len(self._ids):
            prefix_text = self._decode(self._prefix, self._read)
            self.text += self._decode(self._prefix)[len(prefix_text):]
            self._prefix = self._read = len(self._ids)
        out = self._release(final=True)
        self._done = True
        return out

    def _tokens_covering(self, num_chars: int) -> int:
        """The fewest leading tokens whose text reaches num_chars characters (binary search:
        the decoded length grows with the token count)."""
        lo, hi = 1, len(self._ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(0, mid)) >= num_chars:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def _stop_search_start(self) -> int | None:
        """Where to look for stop strings; None before min_tokens tokens (vLLM checks no
        stop until then: one ending at or after the min_tokens-th token counts)."""
        if self._search_from < 0:
            if self.num_tokens < self._min_tokens:
                return None
            before = self._decode(0, self._min_tokens - 1) if self._min_tokens > 1 else ""
            self._search_from = max(0, len(before) - self._hold)
        return max(self._emitted, self._search_from)

    def _release(self, final: bool) -> str:
        start = self._stop_search_start()
        hits = [] if start is None else [
            i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            at = min(hits)
            end = min(at + len(s) for s in self._stops if self.text.startswith(s, at))
            self.num_tokens = self._tokens_covering(end)
            self.text = self.text[:end if self._include else at]
            final = self._done = True
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out, self._emitted = self.text[self._emitted:end], end
        return out
