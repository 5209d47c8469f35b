"""`tandem distill bundle --mix self`: the air-gapped script samples the target's own requests
(transformers, no tandem) before answering them."""
import json

import pytest
from test_airgap_e2e import _script
from test_distill import _tiny_target

from tools.cli import main
from tools.distill.acceptance import load_prompts
from tools.distill.airgap import BundleConfig, _self_prompts_spec
from tools.distill.airgap_prompts import key, sample_requests
from tools.distill.corpus import Prompt, encode_prompt

pytestmark = pytest.mark.integration


def test_requests_sampled_with_transformers_resume_and_split(tmp_path, hf_target, tokenizer):
    spec = {"pad_id": tokenizer.eos_token_id, "self_prompts": _self_prompts_spec(
        tokenizer, BundleConfig(tmp_path / "b", prompts=4, val_fraction=0.5, seed=1))}
    assert set(spec["self_prompts"]["heldout_keys"]) == {key(p) for p in load_prompts(None)}
    got = sample_requests(hf_target, tokenizer, spec, tmp_path, 600, lambda m: None)
    assert len(got) == 4 and len({g["text"] for g in got}) == 4
    assert [g["split"] for g in got] == ["val", "train", "val", "train"]
    for g in got:  # templated exactly as tandem distill encodes a chat prompt
        assert g["ids"] == encode_prompt(tokenizer, Prompt("chat", g["text"], "self"))
        assert len(g["text"].split()) >= 3 and "<|im_" not in g["text"]
    # Cached: a rerun samples nothing (a zero budget would otherwise return less).
    assert sample_requests(hf_target, tokenizer, spec, tmp_path, 0, lambda m: None) == got


def test_a_self_bundle_of_a_target_that_writes_no_requests_fails_clearly(tmp_path,
                                                                         target_paths):
    target = _tiny_target(tmp_path / "target", target_paths)  # random: never ends a turn
    bundle = tmp_path / "bundle"
    assert main(["distill", "bundle", "--out", str(bundle), "--target", str(target),
                 "--prompts", "8", "--mix", "self", "--minutes", "0.2"]) == 0
    spec = json.loads((bundle / "bundle.json").read_text())["self_prompts"]
    assert spec["count"] == 8 and spec["stop_ids"] == [2] and spec["prefix"]
    assert (bundle / "airgap_prompts.py").is_file()
    run = _script(bundle, tmp_path / "work", "cpu")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "no usable request from the target" in run.stderr
