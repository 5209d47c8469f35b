"""Self-written prompts (Magpie): what is kept, resuming, the held-out set left out, a target
that never ends its turn refused. The generator is scripted; the tokenizer is the real one."""
import json

import pytest

from tools.distill.acceptance import load_prompts
from tools.distill.config import DataConfig
from tools.distill.self_prompts import MAX_IDLE_BATCHES, query_prefix, self_prompts

pytestmark = pytest.mark.unit


class ScriptedGen:
    """Answers each generate() with the next scripted batch of texts (None = cut off)."""

    def __init__(self, tokenizer, batches):
        self.tok, self.batches, self.calls = tokenizer, list(batches), []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, params, max_new_tokens, stop_token_ids=()):
        self.calls.append((prompts, params))
        texts = self.batches.pop(0)
        assert len(texts) == len(prompts)
        return [self.tok(t).input_ids + ([] if cut else [self.end])
                for t, cut in ((t or "cut off here and", t is None) for t in texts)]


def test_query_prefix_opens_the_user_turn(tokenizer):
    text = tokenizer.decode(query_prefix(tokenizer))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")


def test_kept_requests_are_finished_distinct_and_not_held_out(tokenizer, tmp_path):
    heldout = load_prompts(None)[0]
    gen = ScriptedGen(tokenizer, [
        ["How do I bake bread at home?", "how do I bake BREAD at home", None, "Hi there"],
        [heldout, "Write a poem about the sea, please.", "What is a prime number?", None],
    ])
    path = tmp_path / "self.jsonl"
    got = self_prompts(gen, tokenizer, 3, 7, path, batch=4)
    assert [p.text for p in got] == ["How do I bake bread at home?",
                                     "Write a poem about the sea, please.",
                                     "What is a prime number?"]
    assert {(p.kind, p.source) for p in got} == {("chat", "self")}
    # Every batch starts from the template's user turn; sampled, seeded, not greedy.
    prompts, params = gen.calls[0]
    assert prompts == [query_prefix(tokenizer)] * 4 and params.temperature > 0
    assert gen.calls[0][1].seed != gen.calls[1][1].seed
    assert len(path.read_text().splitlines()) == 3


def test_resumes_from_its_cache_with_new_draws(tokenizer, tmp_path):
    path = tmp_path / "self.jsonl"
    first = ScriptedGen(tokenizer, [["Tell me a joke about cats.", None]])
    assert len(self_prompts(first, tokenizer, 1, 7, path, batch=2)) == 1
    again = ScriptedGen(tokenizer, [["Tell me a joke about cats.", "Explain tides to me."]])
    got = self_prompts(again, tokenizer, 2, 7, path, batch=2)
    assert [p.text for p in got] == ["Tell me a joke about cats.", "Explain tides to me."]
    assert again.calls[0][1].seed != first.calls[0][1].seed
    assert [json.loads(x)["text"] for x in path.read_text().splitlines()] == [p.text for p in got]
    # Enough cached: the generator is not called at all.
    assert self_prompts(ScriptedGen(tokenizer, []), tokenizer, 2, 7, path, batch=2) == got


def test_a_target_that_never_ends_its_turn_is_refused(tokenizer, tmp_path):
    gen = ScriptedGen(tokenizer, [[None, None]] * MAX_IDLE_BATCHES)
    with pytest.raises(ValueError, match="no usable request from the target"):
        self_prompts(gen, tokenizer, 5, 0, tmp_path / "self.jsonl", batch=2)


def test_deadline_returns_what_there_is(tokenizer, tmp_path):
    gen = ScriptedGen(tokenizer, [])
    assert self_prompts(gen, tokenizer, 5, 0, tmp_path / "s.jsonl", batch=2, deadline=0) == []


def test_unknown_prompt_mix_is_refused():
    with pytest.raises(ValueError, match="prompt mix"):
        DataConfig(mix="magpie")
    assert DataConfig(mix="self").mix == "self"
