"""The rejection sampler under tensor parallelism: a TP=2 target (gloo; this process is rank
0) verifying drafts really sampled from a q of their own gives second tokens distributed as
the TP=1 target's own sampling would (chi-square at 0.1% against p computed at TP=1)."""
import random

import pytest
import torch
import transformers
from chi_square import chi_square
from inproc import run_sessions

from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tandem.models import resolve_model
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.proposer import DraftResult
from verify_service.tp.group import start_leader

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 33, 2, 41]


class SampledDraft:
    """One draft token, really sampled from q over `ids` (so the rejection rule applies)."""

    method = Method.DRAFT_MODEL

    def __init__(self, ids: tuple[int, ...], q: tuple[float, ...], seed: int):
        self.ids, self.q, self.rng = ids, q, random.Random(seed)

    def propose(self, requests):
        return [DraftResult([DraftToken(self.rng.choices(self.ids, self.q)[0], self.ids,
                                        self.q)]) for _ in requests]

    def release(self, session_key):
        pass


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny Llama (4 heads, 2 KV heads) whose LM head is scaled up: peaked distributions,
    so a few hundred samples test them."""
    path = tmp_path_factory.mktemp("tiny-peaked")
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    return path


def _second_token_marginal(model: LlamaModel) -> dict[int, float]:
    """P(second token) at T = 1 = sum over first tokens t of p(t) p(. | t), at TP=1."""
    runner = ModelRunner(model, 8, 16)
    p1 = runner.forward([SeqChunk(PROMPT, 0, [0])])[0].softmax(-1)  # [vocab]
    rows = [ModelRunner(model, 8, 16).forward([SeqChunk(PROMPT + [t], 0, [0])])[0]
            for t in range(model.cfg.vocab_size)]
    p2 = torch.stack(rows).softmax(-1)  # [vocab (first), vocab (second)]
    marginal = p1 @ p2
    return {t: float(v) for t, v in enumerate(marginal.tolist()) if v > 0}


def test_tp2_speculation_keeps_the_targets_distribution(peaked):
    ref = LlamaModel.load(resolve_model(peaked))
    expected = _second_token_marginal(ref)
    top = sorted(expected, key=expected.get, reverse=True)
    ids, q = (top[0], top[3], top[10]), (0.3, 0.5, 0.2)  # a q unlike p
    leader = start_leader(str(peaked), 2, "float32", threads=1, timeout_s=60)
    try:
        def make_runner(num_blocks, block_size):
            return leader.make_runner(num_blocks * block_size * kv_bytes_per_token(
                leader.model), block_size, keep_features=False)

        seconds, drafted, accepted = [], 0, 0
        for seed in range(25):  # 16 sessions a batch: each may verify one draft
            got, d, a, _ = run_sessions(
                leader.model, {Method.DRAFT_MODEL: SampledDraft(ids, q, seed)},
                Method.DRAFT_MODEL, [PROMPT] * 16, SamplingParams(temperature=1.0), 3,
                max_spec_tokens=1, make_runner=make_runner, num_blocks=128)
            seconds += [g[1] for g in got]
            drafted, accepted = drafted + d, accepted + a
    finally:
        leader.close()
    assert drafted >= 100 and 0 < accepted < drafted  # drafts were verified, some rejected
    counts = {t: seconds.count(t) for t in set(seconds)}
    stat, critical = chi_square(counts, expected)
    assert stat < critical, (stat, critical, counts)
