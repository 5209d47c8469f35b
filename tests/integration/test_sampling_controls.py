"""vLLM's sampling controls exact under speculation, on the real target: with each control
on, greedy text is plain decoding's with the same control whatever the method (n-gram and
suffix drafted in the verifier, a draft model's chains over a draft link, Medusa's trees),
and seeded sampling is the plain seeded text. Plain decoding is method none: one row per
round, over the committed text alone."""
import pytest
from inproc import dear_verify, run_sessions

from tandem.engine.model_runner import ModelRunner
from tandem.proposers.draft_model import DraftModelProposer
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from verify_service.drafts.history import HistoryDrafts

pytestmark = pytest.mark.integration
N_NEW = 32
TEXT = "The cat sat on the mat. The cat sat on the mat. The dog sat on the log."


@pytest.fixture(scope="module")
def prompts(tokenizer):
    asks = [f"Repeat this text exactly, three times:\n\n{TEXT}", "Name three rivers."]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": a}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for a in asks]


@pytest.fixture(scope="module")
def uncontrolled(target_model, tokenizer, prompts):
    """Plain greedy text with no control: what each control must change."""
    got, _, _, _ = run_sessions(target_model, {Method.NGRAM: NgramProposer()}, Method.NONE,
                                prompts, SamplingParams(temperature=0.0), N_NEW,
                                stop=(tokenizer.eos_token_id,))
    return got


def controls(uncontrolled, prompts, tokenizer) -> dict[str, tuple[SamplingParams, tuple]]:
    """name -> (greedy params with that control, stop ids), built from the uncontrolled text
    so that each really bites: the banned words and the early stop token occur in it."""
    first, eos = uncontrolled[0], tokenizer.eos_token_id
    pairs = list(zip(first, first[1:]))
    repeated = next(p for i, p in enumerate(pairs) if p in pairs[i + 2:])  # the copy repeats
    return {
        # mild: the text still repeats (so n-gram and suffix draft repeated tokens, whose
        # rows the penalty changes) but not as plain greedy does
        "penalties": (SamplingParams(temperature=0.0, frequency_penalty=0.2,
                                     presence_penalty=0.1, repetition_penalty=1.05), (eos,)),
        "bad_words_min_tokens": (SamplingParams(
            temperature=0.0, bad_words=(repeated, (first[9],)), min_tokens=12),
            (eos, first[2])),
        "bias_allowed": (SamplingParams(
            temperature=0.0, logit_bias=((first[1], -100.0), (first[7], 4.0)),
            allowed_token_ids=tuple(sorted({*prompts[0], *prompts[1], eos}))), (eos,)),
    }


def speculative(target_model, heads, method, prompts, sampling, stop):
    """(texts, drafted, accepted) of `method` drafting for the verifier."""
    kw = {}
    if method in (Method.NGRAM, Method.SUFFIX):
        kw = {"history": HistoryDrafts(8), "max_spec_tokens": 8}
    elif method is Method.MEDUSA:
        kw = {"medusa": heads, "max_spec_tokens": 16, "cost": dear_verify()}
    else:  # a dear verify: rounds verify the drafts even when few land (allowed_token_ids
        kw = {"cost": dear_verify()}  # leaves the unconstrained draft model few)
    proposers = {Method.DRAFT_MODEL: DraftModelProposer(ModelRunner(target_model, 256, 16)),
                 Method.NGRAM: NgramProposer()}
    got, drafted, accepted, _ = run_sessions(target_model, proposers, method, prompts,
                                             sampling, N_NEW, stop=stop, **kw)
    return got, drafted, accepted


@pytest.fixture(scope="module")
def heads(target_model, target_paths):
    from tandem.engine.medusa import load_for

    return load_for(target_model, target_paths, "auto")


@pytest.mark.parametrize("name", ["penalties", "bad_words_min_tokens", "bias_allowed"])
def test_greedy_with_a_control_is_plain_decoding_under_every_method(
        target_model, tokenizer, prompts, uncontrolled, heads, name):
    sampling, stop = controls(uncontrolled, prompts, tokenizer)[name]
    plain, _, _, _ = run_sessions(target_model, {Method.NGRAM: NgramProposer()}, Method.NONE,
                                  prompts, sampling, N_NEW, stop=stop)
    assert plain != uncontrolled  # the control changes the text
    for method in (Method.NGRAM, Method.SUFFIX, Method.DRAFT_MODEL, Method.MEDUSA):
        got, drafted, accepted = speculative(target_model, heads, method, prompts, sampling,
                                             stop)
        assert got == plain, (name, method)
        for word in sampling.bad_words:  # never generated, though drafts propose them
            assert all(tuple(t[i:i + len(word)]) != word for t in got for i in range(len(t)))
        assert drafted > 0, (name, method)  # (penalised text repeats little: n-gram may miss)
        if method is Method.MEDUSA:  # the heads draft ignoring the control:
            assert 0 < accepted < drafted, (name, method)  # kept where it agrees, not beyond
        if method is Method.DRAFT_MODEL:  # drafts with the control (all but min_tokens)
            assert accepted > 0, (name, method)


def test_seeded_sampling_with_penalties_is_the_plain_seeded_text(target_model, tokenizer,
                                                                 prompts, heads):
    sampling = SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.5,
                              repetition_penalty=1.2, min_p=0.05)
    stop = (tokenizer.eos_token_id,)
    plain, _, _, _ = run_sessions(target_model, {Method.NGRAM: NgramProposer()}, Method.NONE,
                                  prompts, sampling, N_NEW, stop=stop)
    drafted = {}
    for method in (Method.NGRAM, Method.DRAFT_MODEL, Method.MEDUSA):
        got, drafted[method], _ = speculative(target_model, heads, method, prompts, sampling,
                                              stop)
        assert got == plain, method
    # (a draft link's first drafts can miss their wait on a loaded host: not each method)
    assert sum(drafted.values()) > 0, drafted
