"""vLLM's flags on Tandem's CLIs (tandem.vllm_compat): the `--speculative-config` examples of
vLLM's documentation parse into the same VerifierConfig / `tandem up` command lines as
Tandem's own flags; unknown keys and methods are errors naming them; --max-model-len,
--max-num-seqs, --[no-]enable-prefix-caching and --num-speculative-tokens mean what vLLM's do."""
import json
import sys
from pathlib import Path

import pytest

from tandem.proposers.ngram import NgramProposer
from tandem.spec import DraftRequest
from tandem.vllm_compat import parse_speculative_config
from tools.cli import build_parser
from tools.up_flags import up_config
from verify_service.cli import config_from_args

pytestmark = pytest.mark.unit
sys.path.insert(0, str(Path(__file__).resolve().parent))


def verifier(*argv):
    return config_from_args(build_parser().parse_args(["verifier", *argv]))


def up(*argv):
    return up_config(build_parser().parse_args(["up", *argv]))


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A speculators EAGLE-3 head naming vLLM's layers (1, 3, 5), and a Medusa-free dir."""
    from eagle3_tiny import head_weights
    from test_eagle_speculators import write_speculators

    root = tmp_path_factory.mktemp("heads")
    return write_speculators(root / "eagle3", head_weights()), root


def test_vllm_doc_examples_equal_the_native_flags(heads):
    eagle3, root = heads
    pairs = [
        # docs/features/spec_decode.md: n-gram
        ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
         ["--max-spec-tokens", "5", "--max-ngram-size", "4", "--min-ngram-size", "4"]),
        # a draft model (no method: vLLM's draft_model); drafted by a draft worker
        ('{"model": "facebook/opt-125m", "num_speculative_tokens": 5}',
         ["--max-spec-tokens", "5"]),
        # EAGLE-3, the example: the verifier ships the head's layers
        (json.dumps({"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": 5,
                     "draft_tensor_parallel_size": 1}),
         ["--max-spec-tokens", "5", "--eagle-feature-layers", "0,2,4", "--medusa", "off"]),
        # EAGLE-1 (not an EAGLE-3 head): the final hidden state, as before
        (json.dumps({"model": str(root), "draft_tensor_parallel_size": 1,
                     "num_speculative_tokens": 2, "method": "eagle"}),
         ["--max-spec-tokens", "2", "--eagle-feature-layers", "final"]),
        ('{"method": "medusa", "model": "/heads/medusa", "num_speculative_tokens": 3}',
         ["--medusa", "/heads/medusa", "--max-spec-tokens", "3"]),
    ]
    for text, native in pairs:
        assert verifier("--speculative-config", text) == verifier(*native), text
    assert verifier("--max-spec-tokens", "5") != verifier()  # the comparison can fail


def test_vllm_engine_flags_and_the_k_alias():
    got = verifier("--max-model-len", "4096", "--max-num-seqs", "8",
                   "--no-enable-prefix-caching", "--num-speculative-tokens", "7")
    assert (got.max_model_len, got.max_num_seqs, got.enable_prefix_caching,
            got.max_spec_tokens) == (4096, 8, False, 7)
    assert verifier("--num-speculative-tokens", "7") == verifier("--max-spec-tokens", "7")
    assert verifier().enable_prefix_caching and verifier().max_model_len == 0
    draft = build_parser().parse_args(["draft", "--num-speculative-tokens", "9",
                                       "--max-model-len", "512"])
    assert (draft.max_spec_tokens, draft.max_context_length) == (9, 512)


def test_errors_name_what_is_wrong():
    cases = [('{"method": "ngram", "foo": 1, "bar_baz": 2}', "unknown keys bar_baz, foo"),
             ('{"method": "mlp_speculator", "model": "x"}', "method 'mlp_speculator'"),
             ('{"method": "eagle3"}', "eagle3 needs a model"),
             ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
             ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "> "),
             ('{"model": "x", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel"),
             ("[1]", "JSON object"), ("{method", "not JSON")]
    for text, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(text)
    with pytest.raises(ValueError, match="config.json, which is not here"):
        verifier("--speculative-config", '{"method": "eagle3", "model": "/no/such/head"}')
    args = build_parser().parse_args(["verifier", "--speculative-config", '{"foo": 1}'])
    with pytest.raises(SystemExit, match="unknown keys foo"):
        args.func(args)


def test_tandem_up_takes_the_speculative_config(heads):
    from tools.launcher import Cluster

    eagle3, _ = heads
    text = json.dumps({"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": 5,
                       "draft_tensor_parallel_size": 1})
    cfg = up("--speculative-config", text)
    native = up("--eagle", str(eagle3), "--num-speculative-tokens", "5")
    assert cfg.eagle == native.eagle == str(eagle3) and cfg.method_preference == "eagle"
    assert cfg.verifier_args == native.verifier_args == ("--max-spec-tokens", "5")
    assert Cluster(cfg, log=lambda *_: None)._eagle3_args()[0] == [
        "--eagle-feature-layers", "0,2,4", "--medusa", "off"]
    ngram = up("--speculative-config", '{"method": "ngram", "prompt_lookup_max": 4}',
               "--max-model-len", "2048", "--no-enable-prefix-caching")
    assert ngram.verifier_args == ("--max-model-len", "2048", "--no-enable-prefix-caching",
                                   "--max-ngram-size", "4", "--min-ngram-size", "4")
    assert ngram.draft_args == ("--max-ngram-size", "4") and ngram.method_preference == "ngram"
    # the verifier's own parser reads what `tandem up` passes it
    assert verifier(*ngram.verifier_args).min_ngram_size == 4
    assert up("--speculative-config", '{"model": "/d"}').draft_model == "/d"


def test_min_ngram_size_is_honoured():
    text = [1, 2, 3, 9, 8, 7, 5, 1, 2, 3]  # "1 2 3" recurs; "3" alone too
    req = DraftRequest(session_key="s", token_ids=text, num_committed=len(text), max_tokens=3)
    assert NgramProposer(3, 8, 1).propose([req])[0].tokens  # matched at n = 3
    short = [5, 6, 4, 7, 6]  # only "6" recurs (n = 1)
    req = DraftRequest(session_key="s", token_ids=short, num_committed=len(short), max_tokens=3)
    assert [t.token_id for t in NgramProposer(3, 8, 1).propose([req])[0].tokens] == [4, 7, 6]
    assert NgramProposer(3, 8, 2).propose([req])[0].tokens == []


def test_max_model_len_is_at_most_the_model_s_and_the_metrics_name():
    from verify_service.config import VerifierConfig

    assert VerifierConfig().context_len(100) == 100
    assert VerifierConfig(max_model_len=50).context_len(100) == 50
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 100"):
        VerifierConfig(max_model_len=200).context_len(100)
    assert VerifierConfig(model="/ckpt/my-model/").metrics_model_name() == "my-model"
    assert verifier("--served-model-name", "x").metrics_model_name() == "x"
    assert VerifierConfig(model="default").metrics_model_name() == VerifierConfig().model
    with pytest.raises(ValueError, match="min_ngram_size"):
        VerifierConfig(max_ngram_size=2, min_ngram_size=3)
