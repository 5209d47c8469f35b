"""Acceptance bookkeeping of `tandem acceptance`, and its simulator on a draft == target."""
import pytest
import torch
import transformers

from tandem.engine.llama import LlamaModel
from tandem.models import resolve_model
from tools.distill.acceptance import (
    AcceptanceConfig,
    mean_accepted,
    per_position_rates,
    simulate,
    speedup,
    summarize,
)

pytestmark = pytest.mark.unit


def test_per_position_rates_are_conditional():
    # 4 rounds with k = 3: accepted counts 0, 1, 3, 3
    rates = per_position_rates([0, 1, 3, 3], 3)
    assert rates == pytest.approx([3 / 4, 2 / 3, 2 / 2])


def test_mean_accepted_from_rates():
    counts = [0, 1, 3, 3, 2, 0, 1]
    rates = per_position_rates(counts, 3)
    for k in (1, 2, 3):  # E[min(N, k)] computed directly
        assert mean_accepted(rates, k) == pytest.approx(sum(min(n, k) for n in counts) / 7)


def test_iid_acceptance_matches_leviathan():
    alpha, k = 0.7, 5
    rates = [alpha] * k
    assert mean_accepted(rates, k) == pytest.approx(alpha * (1 - alpha**k) / (1 - alpha))
    c = 0.05
    want = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))
    assert speedup(rates, k, c) == pytest.approx(want)


def test_summarize_shapes():
    s = summarize([0, 2, 2, 1], 2, c=0.1)
    assert s["alpha"] == 0.75 and len(s["per_position_rate"]) == 2
    assert set(s["mean_accepted"]) == {"1", "2"} and s["rounds"] == 4


def test_config_is_validated():
    with pytest.raises(ValueError):
        AcceptanceConfig(k=0)
    with pytest.raises(ValueError):
        AcceptanceConfig(temperatures=(-1.0,))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return LlamaModel.load(resolve_model(path))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_draft_equal_to_target_is_always_accepted(tiny_model, temperature):
    cfg = AcceptanceConfig(k=4, max_new_tokens=6, temperatures=(temperature,))
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    counts = simulate(tiny_model, tiny_model, prompts, temperature, cfg, stop=())
    assert len(counts) == 3 * 6
    assert per_position_rates(counts, 4) == pytest.approx([1.0] * 4)
