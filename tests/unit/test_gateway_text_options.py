"""TextStream's vLLM options: min_tokens holds stops off, include_stop keeps them, and
skip_special_tokens=False shows special tokens (issue 48)."""
from __future__ import annotations

import pytest

from gateway.text import TextStream

pytestmark = pytest.mark.unit
EOS = 2


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_no_stop_string_counts_before_min_tokens(tokenizer):
    ids = _ids(tokenizer, " stop here stop there")
    first_stop_end = len(_ids(tokenizer, " stop"))
    plain = TextStream(tokenizer, [" stop"])
    assert plain.push(ids) + plain.finish() == "" and plain.num_tokens == first_stop_end
    held = TextStream(tokenizer, [" stop"], min_tokens=first_stop_end + 1)
    assert held.push(ids) + held.finish() == " stop here"
    assert held.stopped


def test_no_stop_token_counts_before_min_tokens(tokenizer):
    ids = _ids(tokenizer, " a") + [EOS] + _ids(tokenizer, " b") + [EOS]
    held = TextStream(tokenizer, stop_token_ids=[EOS], min_tokens=3)
    assert held.push(ids) + held.finish() == " a b" and held.num_tokens == len(ids)
    fresh = held.fresh()
    assert fresh.push(ids[:2]) + fresh.finish() == " a"  # the same options, a new text


def test_include_stop_keeps_the_stop_string_and_counts_its_tokens(tokenizer):
    ids = _ids(tokenizer, " one two three four")
    kept = TextStream(tokenizer, [" two"], include_stop=True)
    assert kept.push(ids) + kept.finish() == " one two"
    assert kept.num_tokens == len(_ids(tokenizer, " one two"))


def test_special_tokens_are_shown_only_when_not_skipped(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = _ids(tokenizer, " a") + [special] + _ids(tokenizer, " b")
    shown = TextStream(tokenizer, skip_special_tokens=False)
    assert shown.push(ids) + shown.finish() == " a<|im_start|> b"
    hidden = TextStream(tokenizer)
    assert hidden.push(ids) + hidden.finish() == " a b"
