"""tandem.grammar: compilation errors, the round masks over chains and trees, commits."""
from __future__ import annotations

import json

import pytest
import torch

from tandem.errors import InvalidArgument
from tandem.grammar import GrammarKind, GrammarSpec
from tandem.grammar.compiler import GrammarError
from tandem.grammar.masks import allowed, apply_masks
from tandem.grammar.state import GrammarState

pytestmark = pytest.mark.unit


def state(compiler, spec: GrammarSpec) -> GrammarState:
    return GrammarState(compiler.matcher(spec), compiler.vocab_size, compiler.eos_ids)


def allowed_ids(mask_row: torch.Tensor, vocab: int) -> set[int]:
    return set(torch.nonzero(allowed(mask_row[None], vocab)[0]).flatten().tolist())


@pytest.mark.parametrize("spec, why", [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "nonsense"}'), "nonsense"),
    (GrammarSpec(GrammarKind.REGEX, "("), "regex"),
    (GrammarSpec(GrammarKind.LARK, "start: undefined_rule"), "undefined_rule"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, "[1, 2"), "json_schema"),
])
def test_uncompilable_grammars_say_why(grammar_compiler, spec, why):
    with pytest.raises(GrammarError, match=why):
        grammar_compiler.matcher(spec)
    with pytest.raises(GrammarError):  # cached: the same answer again
        grammar_compiler.matcher(spec)


def test_hostile_grammars_are_refused_or_bounded(grammar_compiler, tokenizer):
    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(GrammarError):
        grammar_compiler.matcher(GrammarSpec.json_schema(deep))
    with pytest.raises(InvalidArgument, match="characters, more than"):
        GrammarSpec.json_schema({"enum": [f"value-{i}-" + "x" * 20 for i in range(60000)]})
    # A pathological regex compiles lazily; each mask is bounded by llguidance's lexer fuel.
    st = state(grammar_compiler, GrammarSpec(GrammarKind.REGEX, "((a+)+)+(.*a){40}b{5000}"))
    a = tokenizer("a", add_special_tokens=False).input_ids
    assert st.masks(a * 8).shape[0] == 9


@pytest.mark.parametrize("source", ["[]", "[1]", '["a", ""]', "not json"])
def test_bad_choices_are_invalid_arguments(source):
    with pytest.raises(InvalidArgument):
        GrammarSpec(GrammarKind.CHOICE, source)


def test_chain_masks_follow_the_drafts_and_leave_the_matcher(grammar_compiler, tokenizer):
    st = state(grammar_compiler, GrammarSpec.choice(["positive", "negative"]))
    vocab = grammar_compiler.vocab_size
    before = st.masks([])[0].clone()
    good = tokenizer("positive", add_special_tokens=False).input_ids
    bad = tokenizer(" zebra", add_special_tokens=False).input_ids[:1]
    m = st.masks([*good, *bad, good[0]])
    assert torch.equal(m[0], before) and torch.equal(st.masks([])[0], before)
    assert good[0] in allowed_ids(m[0], vocab) and bad[0] not in allowed_ids(m[0], vocab)
    for i, tok in enumerate(good[1:], 1):  # each draft allowed at its own position
        assert tok in allowed_ids(m[i], vocab)
    done = allowed_ids(m[len(good)], vocab)  # "positive" is complete: only EOS
    assert done == {tokenizer.eos_token_id}
    # the forbidden draft and the one after it get the parent's mask
    assert torch.equal(m[len(good) + 1], m[len(good)])
    assert torch.equal(m[len(good) + 2], m[len(good)])
    for i in range(len(good) + 3):  # a draft worker's next-draft mask: the same rows
        assert torch.equal(st.next_mask([*good, *bad, good[0]][:i])[0], m[min(i, len(good))])
    assert torch.equal(st.masks([])[0], before)


def test_tree_masks_equal_each_paths_chain(grammar_compiler, tokenizer):
    spec = GrammarSpec(GrammarKind.REGEX, r"(cat|car|dog)s?")
    st = state(grammar_compiler, spec)
    ca = tokenizer("ca", add_special_tokens=False).input_ids
    d = tokenizer("dog", add_special_tokens=False).input_ids
    t = tokenizer("t", add_special_tokens=False).input_ids
    r = tokenizer("r", add_special_tokens=False).input_ids
    assert len(ca) == len(t) == len(r) == 1
    drafts = [ca[0], t[0], r[0], *d]  # root -> ca -> {t, r}; root -> dog
    parents = (-1, 0, 0, *range(-1, len(d) - 1))
    tree = st.masks(drafts, parents)
    assert torch.equal(tree[:3], st.masks([ca[0], t[0]]))
    assert torch.equal(tree[3], st.masks([ca[0], r[0]])[2])
    assert torch.equal(tree[4:], st.masks(d)[1:])


def test_a_copy_walks_tree_paths_without_moving_the_session(grammar_compiler, tokenizer):
    """A draft worker's tree gets a copy past the session's drafts; its mask under a path is
    the chain's mask there, None under a forbidden path, and the original never moves."""
    st = state(grammar_compiler, GrammarSpec(GrammarKind.REGEX, r"(cat|car|dog)s?"))
    before = st.masks([])[0].clone()
    ca, t = (tokenizer(w, add_special_tokens=False).input_ids for w in ("ca", "t"))
    copy = st.copy_after(ca)
    assert torch.equal(copy.mask_after([])[0], st.masks(ca)[1])
    assert torch.equal(copy.mask_after(t)[0], st.masks([*ca, *t])[2])
    assert copy.mask_after(tokenizer("dog", add_special_tokens=False).input_ids) is None
    assert torch.equal(copy.mask_after([])[0], st.masks(ca)[1])  # the copy ends where it was
    assert torch.equal(st.masks([])[0], before)


def test_commit_advances_and_refuses_forbidden_tokens(grammar_compiler, tokenizer):
    st = state(grammar_compiler, GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False}))
    text = tokenizer('{"a": 12}', add_special_tokens=False).input_ids
    assert st.commit(text)
    assert allowed_ids(st.masks([])[0], grammar_compiler.vocab_size) == {
        tokenizer.eos_token_id}
    assert st.commit([tokenizer.eos_token_id])
    other = state(grammar_compiler, GrammarSpec.choice(["x"]))
    assert not other.commit(tokenizer("y", add_special_tokens=False).input_ids)


def test_forced_tokens_are_what_the_grammar_allows_alone(grammar_compiler, tokenizer):
    st = state(grammar_compiler, GrammarSpec.json_schema(
        {"type": "object", "properties": {"answer": {"type": "string"}},
         "required": ["answer"], "additionalProperties": False}))
    forced = tokenizer.decode(st.forced)
    assert forced.startswith('{"answer":')  # one spelling: the key and separator are forced
    assert st.commit(st.forced)
    assert st.commit(tokenizer(' "yes"', add_special_tokens=False).input_ids)
    assert tokenizer.decode(st.forced) == "}"


def test_apply_masks_sets_forbidden_logits_to_minus_inf():
    vocab = 70
    logits = torch.randn(5, vocab)
    m = torch.zeros(3, 3, dtype=torch.int32)
    m[:, 1] = 1 << 4  # token 36 only
    out = apply_masks(logits, [None, m], [2, 3])
    assert torch.equal(out[:2], logits[:2])
    assert (out[2:].argmax(-1) == 36).all()
    assert torch.isinf(out[2:, :36]).all() and torch.isinf(out[2:, 37:]).all()
    assert apply_masks(logits, [None], [5]) is logits


def test_spec_key_is_content():
    a = GrammarSpec.json_schema({"b": 1, "a": 2})
    assert a.key == GrammarSpec.json_schema({"a": 2, "b": 1}).key
    assert a.key != GrammarSpec(GrammarKind.REGEX, a.source).key
    assert json.loads(a.source) == {"a": 2, "b": 1}


def test_grammars_travel_to_draft_workers_and_bad_kinds_are_refused():
    from draft_service.server import control_from_proto
    from tandem.spec import Invalid, Open
    from verify_service.drafts.link import control_to_proto

    sent = Open("s", [1, 2, 3], grammar=GrammarSpec.choice(["a"]), grammar_start=2)
    back = control_from_proto(control_to_proto(sent))
    assert back.grammar == sent.grammar and back.grammar_start == 2
    bad = control_to_proto(sent)
    bad.open.grammar.kind = 9
    assert isinstance(control_from_proto(bad), Invalid)
    assert control_from_proto(control_to_proto(Open("s", [1]))).grammar is None


def test_a_generate_request_with_a_bad_grammar_is_invalid():
    from tandem.v1 import common_pb2, verify_pb2
    from verify_service.server import _grammar

    req = verify_pb2.GenerateRequest(grammar=common_pb2.Grammar(kind=2, source="a+"))
    assert _grammar(req) == GrammarSpec(GrammarKind.REGEX, "a+")
    assert _grammar(verify_pb2.GenerateRequest()) is None
    for grammar in (common_pb2.Grammar(kind=7, source="x"), common_pb2.Grammar(kind=1)):
        with pytest.raises(InvalidArgument):
            _grammar(verify_pb2.GenerateRequest(grammar=grammar))


def test_boolean_schemas():
    assert GrammarSpec.json_schema(True) == GrammarSpec.json_schema({})
    with pytest.raises(InvalidArgument, match="admits no text"):
        GrammarSpec.json_schema(False)
