"""A target whose every layer has a sliding window, through the verifier's engine: KV blocks
that fall out of the window are released while sessions run and handed to other sessions (a
pool of 20 blocks of 4 where three sessions of 92 tokens would need 69; releasing 8 positions
too early fails this test), and the text is still transformers', plain and with speculation.
A target with some full-attention layers keeps every block."""
import sys
from pathlib import Path

import pytest
import torch
from inproc import run_sessions

from tandem.engine.llama import LlamaModel
from tandem.models import resolve_model
from tandem.proposers.ngram import NgramProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from verify_service.drafts.history import HistoryDrafts

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_families import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window"])
def test_windowed_target_releases_blocks_and_keeps_transformers_text(tmp_path, family):
    hf = make_checkpoint(tmp_path, family)
    ours = LlamaModel.load(resolve_model(tmp_path))
    window = ours.cfg.kv_window
    assert (window > 0) == (family == "mistral-window")  # qwen2 here: some full layers
    gen = torch.Generator().manual_seed(5)
    # repeated text so that n-gram lookup drafts; three sessions share the pool
    prompts = [torch.randint(1, 101, (8,), generator=gen).repeat(4).tolist() for _ in range(3)]
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=60, min_new_tokens=60, do_sample=False,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for method in (Method.NONE, Method.NGRAM):
        got, drafted, _, _ = run_sessions(
            ours, {Method.NGRAM: NgramProposer()}, method, prompts,
            SamplingParams(temperature=0.0), 60, history=HistoryDrafts(6), max_spec_tokens=6,
            kv_window=window, block_size=4, num_blocks=20 if window else 80)
        assert got == want, (family, method)
        assert method is Method.NONE or drafted > 0
