"""`tandem distill --method eagle` with the target's own requests (--prompt-mix self) and a
fine-tune of an exported head (--init-head)."""
import json

import pytest
from test_distill import _tiny_target

from tandem.device import place
from tandem.engine.draft_vocab import DRAFT_VOCAB_FILE
from tandem.engine.eagle import EAGLE_CARD
from tools.cli import main
from tools.distill.config import DataConfig
from tools.distill.data import generate_dataset, target_runner
from tools.distill.eagle import load_feature_seqs

pytestmark = pytest.mark.integration


def test_self_prompts_from_the_real_target(tmp_path, target_paths, tokenizer):
    """The instruct target writes its own requests; they are answered with features kept."""
    cfg = DataConfig(num_prompts=4, batch_size=4, max_new_tokens=6, dtype="float32",
                     kv_cache_mb=64, mix="self", features=True, seed=3)
    runner = target_runner(target_paths, cfg, place("cpu", "float32"))
    generate_dataset(target_paths.root, tokenizer, runner, cfg, tmp_path, log=lambda m: None)
    prompts = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and {p["source"] for p in prompts} == {"self"}
    assert len({p["text"] for p in prompts}) == 4
    assert all("<|im_" not in p["text"] and len(p["text"].split()) >= 3 for p in prompts)
    seqs = load_feature_seqs(tmp_path)
    assert len(seqs) == 4 and all(len(s.features) == len(s.ids) - 1 for s in seqs)


def test_init_head_fine_tunes_an_exported_head(tmp_path, target_paths):
    target = _tiny_target(tmp_path / "target", target_paths)
    base = ["distill", "--method", "eagle", "--target", str(target), "--num-prompts", "8",
            "--gen-batch", "4", "--max-new-tokens", "12", "--eagle-vocab", "512",
            "--epochs", "2", "--batch-tokens", "256", "--time-budget", "0",
            "--heldout-prompts", "0"]
    first, second = tmp_path / "a", tmp_path / "b"
    assert main([*base, "--out", str(first), "--data-dir", str(tmp_path / "d1")]) == 0
    assert main([*base, "--out", str(second), "--data-dir", str(tmp_path / "d2"),
                 "--seed", "5", "--init-head", str(first)]) == 0
    a, b = (json.loads((d / EAGLE_CARD).read_text()) for d in (first, second))
    assert b["earlier_commands"] == [a["command"]] and "--init-head" in b["command"]
    # The curve goes on from the head it started from; the vocabulary is that head's.
    (pa,), (pa2, pb) = a["learning_curve"], b["learning_curve"]
    assert pa2 == pa and pb["train_positions"] == pa["train_positions"] + \
        b["progress"]["steps"] * 256
    assert (second / DRAFT_VOCAB_FILE).read_text() == (first / DRAFT_VOCAB_FILE).read_text()


def test_init_head_must_be_an_exported_head(tmp_path, capsys):
    assert main(["distill", "--method", "eagle", "--out", str(tmp_path / "o"),
                 "--init-head", str(tmp_path)]) != 0
    assert "not an exported Tandem EAGLE head" in capsys.readouterr().err


def test_init_head_of_another_target_is_refused(tmp_path, target_paths, eagle_dir, capsys):
    target = _tiny_target(tmp_path / "target", target_paths)  # same tokenizer, width 32
    assert main(["distill", "--method", "eagle", "--target", str(target), "--out",
                 str(tmp_path / "o"), "--data-dir", str(tmp_path / "d"), "--num-prompts", "4",
                 "--gen-batch", "4", "--max-new-tokens", "4", "--heldout-prompts", "0",
                 "--init-head", str(eagle_dir)]) != 0
    assert "was trained for another target" in capsys.readouterr().err
