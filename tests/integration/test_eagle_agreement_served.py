"""The shipped EAGLE head on the real target: the trainer's validation and the served proposer
give one agreement figure on the target's greedy answers to held-out chat prompts (the
features the served path reads are the very fp16 rows the trainer reads)."""
import pytest

from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tools.distill.acceptance import load_prompts
from tools.distill.config import EagleTrainConfig
from tools.distill.corpus import Prompt, encode_prompt
from tools.distill.eagle_agreement import GREEDY, record_answers, served_top1, trained_top1

pytestmark = pytest.mark.integration


def test_trained_and_served_agreement_agree_on_heldout_answers(target_model, tokenizer,
                                                               eagle_dir):
    prompts = [encode_prompt(tokenizer, Prompt("chat", t, "heldout"))
               for t in load_prompts(None)[:3]]
    seqs = record_answers(ModelRunner.with_memory(target_model, 32 << 20), tokenizer, prompts,
                          [GREEDY] * len(prompts), 16)
    assert len(seqs) == 3 and all(s.gen_start == len(p) for s, p in zip(seqs, prompts))
    trained = trained_top1(eagle_dir, seqs, EagleTrainConfig())
    served = served_top1(EagleProposer.load(ModelPaths(eagle_dir), 16 << 20), seqs)
    assert served["positions"] == trained["positions"] == sum(
        len(s.ids) - s.gen_start for s in seqs)
    assert served["served"] == pytest.approx(trained["top1_step1"], abs=1e-4)  # rounded
