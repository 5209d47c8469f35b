"""Predicted Outputs in the verifier's step (tandem/proposers/prediction.py): a prediction is a
draft only. Greedy text is the plain text whatever the prediction (exact, partly wrong,
unrelated) and the method (none, auto); one that matches the answer is mostly accepted and
counted; sampled with a wrong prediction, the first tokens are distributed as plain."""
import pytest
from chi_square import chi_square
from inproc import run_sessions, target_joint_top2

from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.cost import CostModel
from verify_service.drafts.history import HistoryDrafts

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)
TEXT = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
IDLE = {Method.NGRAM: NgramProposer()}  # a draft worker no session here goes to
FLAT = {q: 10.0 for q in range(1, 80)}  # every draft pays: the choice is by reach alone


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat(tokenizer, f"Repeat this code exactly:\n\n{TEXT}"),
            chat(tokenizer, f"Rename width to w in this code:\n\n{TEXT}")]


@pytest.fixture(scope="module")
def plain(target_model, tokenizer, prompts):
    eos = (tokenizer.eos_token_id,)
    got, _, _, _ = run_sessions(target_model, IDLE, Method.NONE, prompts, GREEDY, 48, stop=eos)
    return got


def predictions(tokenizer, plain: list[list[int]]) -> dict[str, list[list[int]]]:
    """Per kind, one prediction per prompt: the answer itself; the answer with a token
    changed every 9 and two inserted; text that has nothing to do with it."""
    def damaged(ids: list[int]) -> list[int]:
        out = [t + 1 if i % 9 == 4 else t for i, t in enumerate(ids)]
        return out[:10] + [11, 12] + out[10:]
    other = tokenizer("The committee meets on Thursdays to discuss the budget.").input_ids
    return {"exact": [list(p) for p in plain], "partly wrong": [damaged(p) for p in plain],
            "unrelated": [list(other) for _ in plain]}


@pytest.mark.parametrize("method", [Method.NONE, Method.AUTO])
def test_greedy_text_is_plain_whatever_the_prediction(target_model, tokenizer, prompts, plain,
                                                      method):
    eos = (tokenizer.eos_token_id,)
    for kind, preds in predictions(tokenizer, plain).items():
        rounds = []
        got, drafted, accepted, _ = run_sessions(
            target_model, IDLE, method, prompts, GREEDY, 48, stop=eos, max_spec_tokens=8,
            history=HistoryDrafts(8), cost=CostModel(dict(FLAT)), predictions=preds,
            rounds=rounds)
        assert got == plain, (method, kind)
        last = [r[-1] for r in rounds]
        took = sum(o.prediction_accepted for o in last)
        missed = sum(o.prediction_rejected for o in last)
        assert took <= accepted and took + missed <= drafted
        if kind == "exact":  # mostly accepted: far fewer rounds than tokens
            assert took >= 0.7 * sum(map(len, got)), (method, took)
            assert all(len(r) < 0.5 * len(g) for r, g in zip(rounds, got))
        if kind == "partly wrong":
            assert took > 0 and missed > 0, (method, took, missed)
        if method is Method.NONE and kind == "unrelated":
            assert took < 5


def test_sampled_first_tokens_with_a_wrong_prediction_are_distributed_as_plain(
        target_model, tokenizer):
    """Wrong where it counts: after either first token, the prediction's next one is the
    target's second choice, verified in the second round (the first is the prefill's) and
    sometimes kept, sometimes replaced by the residual's draw; the joint of the first two
    tokens is still the target's (T=1, top-k 2)."""
    prompt = chat(tokenizer, "Pick a random fruit.")
    joint = target_joint_top2(target_model, prompt)
    def second_choice(after: int | None) -> int:
        options = {}
        for (a, b), p in joint.items():
            key = a if after is None else b
            if after is None or a == after:
                options[key] = options.get(key, 0.0) + p
        return sorted(options, key=options.get)[0]
    a2 = second_choice(None)
    a1 = next(a for a, _ in joint if a != a2)
    # after a2 (aligned at its start) it proposes the next; after a1, it re-aligns on a1
    prediction = [a2, second_choice(a2), a1, second_choice(a1)]
    sampling = SamplingParams(temperature=1.0, top_k=2)
    got, rounds = [], []
    for _ in range(10):  # 20 sessions an engine: k_allowed stays >= 1 (max_verify_tokens)
        g, _, _, _ = run_sessions(
            target_model, IDLE, Method.NONE, [prompt] * 20, sampling, 2, max_spec_tokens=1,
            history=HistoryDrafts(8), cost=CostModel(dict(FLAT)),
            predictions=[prediction] * 20, rounds=rounds)
        got += g
    verified = [tuple(g[:2]) for g, r in zip(got, rounds) if len(r) > 1 and r[1].drafted]
    assert len(verified) >= 180
    counts = {o: verified.count(o) for o in set(verified)}
    assert 0 < sum(r[-1].prediction_accepted for r in rounds) < len(verified)
    stat, critical = chi_square(counts, joint)
    assert stat < critical, (counts, joint)
