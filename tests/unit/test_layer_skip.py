"""Layer-skip sets: validation, files, resolution, the shared-weight view, and the search's
scoring on a tiny random model (no real target)."""
import json

import pytest
import torch
import transformers

from tandem.engine.generate import LocalGenerator
from tandem.engine.layer_skip import SHIPPED_DIR, SkipSet, resolve_skip_set, skip_view
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelError, ModelPaths, resolve_model
from tandem.sampling_params import SamplingParams
from tools.skip_search import (
    SearchConfig,
    greedy_counts,
    pipelined_speedup,
    score,
    search,
    target_paths,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("layers, skip, match", [
    (1, (), "num_layers"), (4, (4,), r"\[0, 4\)"), (4, (-1,), r"\[0, 4\)"),
    (4, (1, 1), "repeat"), (3, (0, 1, 2), "at least one"), (4, ("1",), "ints")])
def test_bad_skip_sets_are_refused(layers, skip, match):
    with pytest.raises(ValueError, match=match):
        SkipSet(layers, skip)


def test_skip_set_round_trips_and_resolves(tmp_path):
    s = SkipSet(6, (4, 1))
    assert s.skip == (1, 4) and s.kept == [0, 2, 3, 5]
    (tmp_path / "layer_skip.json").write_text(s.to_json(model="x", k=3))
    paths = ModelPaths(tmp_path)
    assert resolve_skip_set("auto", paths) == s  # the set saved with the checkpoint
    assert resolve_skip_set("off", paths) is None
    other = tmp_path / "other.json"
    other.write_text(SkipSet(6, (2,)).to_json())
    assert resolve_skip_set(str(other), paths) == SkipSet(6, (2,))
    assert resolve_skip_set("auto", ModelPaths(tmp_path / "nothing")) is None
    other.write_text("{not json")
    with pytest.raises(ModelError, match="cannot read a layer-skip set"):
        resolve_skip_set(str(other), paths)


def test_shipped_sets_are_valid():
    for path in SHIPPED_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        assert SkipSet(data["num_layers"], tuple(data["skip"])).skip == tuple(data["skip"])


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=6, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    root = tmp_path_factory.mktemp("skip")
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return LlamaModel.load(resolve_model(tiny_root))


def test_view_shares_weights_and_equals_the_model_without_those_layers(tiny, tiny_root,
                                                                         tmp_path):
    view = skip_view(tiny, SkipSet(6, (1, 4)))
    assert view.cfg.num_layers == 4 and tiny.cfg.num_layers == 6
    assert view.layers[1] is tiny.layers[2] and view.embed is tiny.embed
    # Reference: a checkpoint with those layers really removed.
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_root)
    hf.model.layers = torch.nn.ModuleList([hf.model.layers[i] for i in (0, 2, 3, 5)])
    hf.config.num_hidden_layers = 4
    hf.save_pretrained(tmp_path)
    reduced = LlamaModel.load(resolve_model(tmp_path))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]

    def logits(model):
        return ModelRunner(model, 4, 16).forward([SeqChunk(ids, 0, [0], len(ids))])

    torch.testing.assert_close(logits(view), logits(reduced), rtol=0, atol=1e-5)
    assert not torch.allclose(logits(view), logits(tiny), atol=1e-3)
    with pytest.raises(ModelError, match="6-layer"):
        skip_view(view, SkipSet(6, (1,)))


def test_greedy_counts_match_a_literal_round_by_round_check(tiny):
    prompts = [[5, 7, 9, 11], [2, 3]]
    paths = target_paths(tiny, prompts, 12, ())
    starts = [4, 2]
    view = skip_view(tiny, SkipSet(6, (2, 3)))
    counts = greedy_counts(view, paths, starts, 3)
    expect = []
    greedy = SamplingParams(temperature=0.0)
    for t in range(12):
        for p, s in zip(paths, starts):
            # k greedy drafts of the view from the true prefix, matched against the path.
            drafts = LocalGenerator(ModelRunner(view, 8, 16)).generate([p[:s + t]], greedy, 3)[0]
            truth, n = p[s + t:], 0
            while n < min(3, len(truth)) and drafts[n] == truth[n]:
                n += 1
            expect.append(n)
    assert counts == expect


def test_score_prefers_what_pays():
    k, sp, alpha = score([3, 3, 3, 3], 3, 0.1)  # always accepted, cheap: long proposals
    assert (k, alpha) == (3, 1.0) and sp == pytest.approx(4 / 1.3)
    k, sp, _ = score([0, 0, 1, 0], 3, 0.5)
    assert k == 1 and sp < 1


def test_pipelined_cost_hides_a_draft_no_slower_than_the_target():
    assert pipelined_speedup([1.0], 1, 0.5) == pytest.approx(2.0)  # drafting fully hidden
    assert pipelined_speedup([0.0], 1, 0.5) == pytest.approx(1 / 1.5)  # every round restarts
    # Drafting 4 tokens at c = 0.5 takes 2 forwards: one beyond the verify.
    assert pipelined_speedup([1.0] * 4, 4, 0.5) == pytest.approx(5 / 2)
    with pytest.raises(ValueError, match="objective"):
        SearchConfig(objective="fastest")


def test_search_runs_its_trials_and_always_keeps_the_first_and_last_layers(tiny):
    cfg = SearchConfig(trials=4, k=2, max_new_tokens=6, num_prompts=2, timing_reps=2)
    seen = []
    results = search(tiny, [[5, 7, 9], [2, 3, 4]], (), cfg,
                     on_trial=lambda i, r: seen.append(i), progress=False)
    assert seen == [0, 1, 2, 3] and len(results) == 4
    for r in results:
        assert 0 not in r.skip.skip and 5 not in r.skip.skip  # first and last always kept
        assert 0 < r.c < 1.5 and 0 <= r.alpha <= 1 and 1 <= r.k <= 2
