"""Incremental detokenisation with stop strings: what the client sees of committed tokens.

Tokens arrive a round at a time; text is released only once it can no longer change (a
multi-byte character split across tokens, or a possible stop string straddling rounds).
The incremental decoding is `tokenizers`' DecodeStream where the tokenizer is a fast one
(measured 1.3-7x the tokens/s of the offsets over `decode` below, 1.3-3.4x through the
TextStream, the same text every round: docs/results/decode-stream-2026-11-28.md); vLLM's
prefix/read offsets otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT = 6  # tokens of context before the text to flush, so a leading space decodes right


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class OffsetDetokenizer:
    """vLLM's prefix/read offsets over `decode`: a token that ends inside a multi-byte
    character decodes to U+FFFD, so its text is held until the character completes."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True,
                 ids: Sequence[int] = (), done: int = 0):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self.ids: list[int] = list(ids)
        self._read = done  # tokens whose text is out
        self._prefix = max(0, done - _CONTEXT)

    def decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; the text they complete ("" while a character is incomplete)."""
        self.ids.extend(token_ids)
        prefix_text = self.decode(self._prefix, self._read)
        new_text = self.decode(self._prefix)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def finish(self) -> str:
        """The text of the tokens held back, even an incomplete character's (U+FFFD)."""
        if self._read >= len(self.ids):
            return ""
        out = self.decode(self._prefix)[len(self.decode(self._prefix, self._read)):]
        self._prefix = self._read = len(self.ids)
        return out


class StreamDetokenizer:
    """The same through `tokenizers`' DecodeStream (one Rust call a round, the round's
    tokens at once); should it ever refuse a step, the offsets above carry on."""

    def __init__(self, tokenizer: Decoder, backend: Tokenizer, skip_special_tokens: bool = True):
        self._tok, self._backend, self._skip = tokenizer, backend, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._read = 0  # tokens whose text is out
        self._fallback: OffsetDetokenizer | None = None

    def decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        if self._fallback is not None:
            return self._fallback.push(token_ids)
        if not token_ids:
            return ""
        try:
            out = self._stream.step(self._backend, list(token_ids))
        except Exception:  # noqa: BLE001 - any refusal: the offsets give the same text
            self._fallback = OffsetDetokenizer(self._tok, self._skip, self.ids, self._read)
            self.ids = self._fallback.ids
            return self._fallback.push(token_ids)
        self.ids.extend(token_ids)
        if out is None:
            return ""
        self._read = len(self.ids)
        return out

    def finish(self) -> str:
        if self._fallback is not None:
            return self._fallback.finish()
        return OffsetDetokenizer(self._tok, self._skip, self.ids, self._read).finish()


def detokenizer(tokenizer: Any, skip_special_tokens: bool = True):
    """DecodeStream over a fast tokenizer's backend; the offsets over any other decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return StreamDetokenizer(tokenizer, backend, skip_special_tokens)
    return OffsetDetokenizer(tokenizer, skip_special_tokens)


class TextStream:
    """Committed token ids in, client-visible text out.

    Detokenizes incrementally (`detokenizer`): a character split across tokens is held
    until it completes. Holds back len(longest stop string) - 1 characters so a stop string split
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
        self._detok = detokenizer(tokenizer, skip_special_tokens)
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
        return self._detok.decode(start, end)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that may be shown now."""
        if self._done:
            return ""
        kept: list[int] = []
        for t in token_ids:
            self.num_tokens += 1
            if t in self._stop_ids and self.num_tokens >= self._min_tokens:
                self.stopped = True  # the stop/eos token is shown only with include_stop
                if self._include:
                    kept.append(t)
                break
            kept.append(t)
        self.text += self._detok.push(kept)
        if self.stopped:
            return self.finish()
        return self._release(final=False)

    def finish(self) -> str:
        """Generation ended: flush whatever is left (even an incomplete character)."""
        if self._done:
            return ""
        self.text += self._detok.finish()
        out = self._release(final=True)
        self._done = True
        return out

    def _tokens_covering(self, num_chars: int) -> int:
        """The fewest leading tokens whose text reaches num_chars characters (binary search:
        the decoded length grows with the token count)."""
        lo, hi = 1, len(self._detok.ids)
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
