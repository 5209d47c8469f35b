"""Incremental detokenisation (gateway/text.py): `tokenizers`' DecodeStream, which the gateway
uses over a fast tokenizer, releases exactly the text the hand-written prefix/read offsets do,
round by round, on multi-byte characters split across tokens and on speculative rounds of
several tokens; a refused step falls back to the offsets; other decoders get the offsets."""
from __future__ import annotations

import pytest

from gateway.text import OffsetDetokenizer, StreamDetokenizer, TextStream, detokenizer
from tools.bench.decode_stream import rounds

pytestmark = pytest.mark.unit
TEXT = "Speculative café, naïve 日本語のテキスト 🎉👩‍💻 e\u0301 ∑∫ — done.\n" * 3


def _run(d, chunks):
    return [d.push(c) for c in chunks] + [d.finish()]


@pytest.mark.parametrize("most", [1, 4, 8])
def test_decode_stream_releases_what_the_offsets_release(tokenizer, most):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    chunks = rounds(ids, most, seed=most)
    fast = _run(StreamDetokenizer(tokenizer, tokenizer.backend_tokenizer), chunks)
    assert fast == _run(OffsetDetokenizer(tokenizer), chunks)
    assert "".join(fast) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in part for part in fast)  # no half character is ever shown


def test_an_incomplete_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji
    for d in (StreamDetokenizer(tokenizer, tokenizer.backend_tokenizer),
              OffsetDetokenizer(tokenizer)):
        assert d.push(ids[:-1]) == ""
        assert d.finish() == tokenizer.decode(ids[:-1])  # U+FFFD, as decode gives it


def test_the_gateway_uses_decode_stream_over_a_fast_tokenizer_only(tokenizer):
    assert isinstance(detokenizer(tokenizer), StreamDetokenizer)

    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert isinstance(detokenizer(Plain()), OffsetDetokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    a, b = TextStream(tokenizer), TextStream(Plain())
    assert _run(a, rounds(ids, 5, 0)) == _run(b, rounds(ids, 5, 0))


def test_a_refused_step_falls_back_to_the_offsets(tokenizer):
    class Refusing:
        def __init__(self):
            self.calls = 0

        def step(self, backend, ids):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("refused")
            return real.step(backend, ids)

    from tokenizers.decoders import DecodeStream

    real = DecodeStream(skip_special_tokens=True)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    chunks = rounds(ids, 3, 0)
    d = StreamDetokenizer(tokenizer, tokenizer.backend_tokenizer)
    d._stream = Refusing()
    assert "".join(_run(d, chunks)) == TEXT
    assert d.ids == ids
