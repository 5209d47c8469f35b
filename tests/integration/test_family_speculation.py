"""Speculation on every served family (tests/unit/test_families.py's tiny random checkpoints):
a draft model (the target minus one layer: same vocabulary, another distribution) and n-gram
drafts through the verifier's engine give plain decoding's text, greedy and seeded."""
import sys
from pathlib import Path

import pytest
import torch
from inproc import run_sessions

from tandem.engine.layer_skip import SkipSet, skip_view
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import resolve_model
from tandem.proposers.draft_model import DraftModelProposer
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from verify_service.drafts.history import HistoryDrafts

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_families import FAMILIES, make_checkpoint  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_draft_model_and_ngram_drafts_keep_plain_text(tmp_path, family):
    make_checkpoint(tmp_path, family)
    target = LlamaModel.load(resolve_model(tmp_path))
    draft = skip_view(target, SkipSet(target.cfg.num_layers, (1,)))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 101, (6,), generator=gen).repeat(4).tolist() for _ in range(2)]
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)):
        plain, _, _, _ = run_sessions(target, {Method.NGRAM: NgramProposer()}, Method.NONE,
                                      prompts, sampling, 32, kv_window=target.cfg.kv_window)
        for method in (Method.DRAFT_MODEL, Method.NGRAM):
            proposers = {Method.DRAFT_MODEL: DraftModelProposer(ModelRunner(draft, 128, 16)),
                         Method.NGRAM: NgramProposer()}
            got, drafted, accepted, _ = run_sessions(
                target, proposers, method, prompts, sampling, 32, max_spec_tokens=4,
                history=HistoryDrafts(4), kv_window=target.cfg.kv_window)
            assert got == plain, (family, method, sampling)
            assert drafted > 0, (family, method)
            if method is Method.DRAFT_MODEL and sampling.is_greedy:
                assert accepted > 0, family  # the draft's tokens really were verified and kept
