"""`tandem distill` end to end on a tiny random target that shares the real target's tokenizer:
data generation with our runner, distillation, export, and loading the result both in
transformers and in our LlamaModel; plus the clear errors on unusable targets."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tandem.engine.draft_vocab import DRAFT_VOCAB_FILE
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelError, resolve_model
from tools.cli import main
from tools.distill.config import DataConfig, DraftArch, TrainConfig
from tools.distill.pipeline import CARD_FILE, DistillJob, check_target, run_distill

pytestmark = pytest.mark.integration

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
PROMPTS = ["Say hello.", "What is two plus two?", "Name a colour.", "Continue: once upon",
           "Explain rain.", "Write one word.", "Count to five.", "What is a cat?"]


def _tiny_target(root: Path, target_paths, architectures=None, layers: int = 2) -> Path:
    root.mkdir(parents=True)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # a peaky, learnable teacher instead of a near-uniform one
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(root)
    for name in TOKENIZER_FILES:
        if (target_paths.root / name).is_file():
            shutil.copy(target_paths.root / name, root / name)
    if architectures is not None:
        cfg_path = root / "config.json"
        cfg_json = json.loads(cfg_path.read_text())
        cfg_json["architectures"] = architectures
        cfg_path.write_text(json.dumps(cfg_json))
    return root


def _job(target: Path, tmp_path: Path, steps: int = 60) -> DistillJob:
    return DistillJob(
        target=str(target), out_dir=tmp_path / "draft", data_dir=tmp_path / "data",
        data=DataConfig(num_prompts=len(PROMPTS), batch_size=4, max_new_tokens=24,
                        sampled_every=2, kv_cache_mb=16),
        arch=DraftArch(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=512),
        train=TrainConfig(steps=steps, batch_tokens=512, lr=3e-3, warmup=5))


def test_distill_tiny_target_end_to_end(tmp_path, target_paths):
    target = _tiny_target(tmp_path / "target", target_paths)
    (tmp_path / "data").mkdir()
    # A fixed prompt file in the cache is used as is (this is also how a resumed run keeps
    # its prompt set), so the test does not depend on the offline corpus being installed.
    (tmp_path / "data" / "prompts.jsonl").write_text("".join(
        json.dumps({"kind": "chat", "text": p, "source": "test"}) + "\n" for p in PROMPTS))
    out = run_distill(_job(target, tmp_path), log=lambda m: None)

    card = json.loads((out / CARD_FILE).read_text())
    assert card["loss"]["last_steps"] < 0.8 * card["loss"]["first_steps"]
    assert card["data"]["sequences"] == len(PROMPTS) and card["data"]["sampled_sequences"] == 4
    assert card["progress"]["steps"] == 60

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    ours = LlamaModel.load(resolve_model(out))
    kept = json.loads((out / DRAFT_VOCAB_FILE).read_text())["target_ids"]
    assert hf.config.vocab_size == len(kept) == 512 and ours.cfg.vocab_size == 49152
    # Same logits in both, once draft rows are mapped back to target ids.
    ids = [kept[i] for i in (5, 9, 200, 3, 17)]
    runner = ModelRunner(ours, num_blocks=4, block_size=16)
    got = runner.forward([SeqChunk(ids, 0, [0], num_logits=len(ids))])
    with torch.no_grad():
        draft_rows = torch.tensor([[kept.index(t) for t in ids]])
        ref = hf(draft_rows).logits[0]
    assert torch.allclose(got[:, kept], ref, atol=1e-3)
    outside = torch.ones(49152, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(got[:, outside]).all()

    # Resume: the cached data is reused and training continues from the saved step.
    job = _job(target, tmp_path, steps=70)
    run_distill(DistillJob(**{**job.__dict__, "resume": True}), log=lambda m: None)
    assert json.loads((out / CARD_FILE).read_text())["progress"]["steps"] == 70


def test_init_from_target_copies_the_first_layers(tmp_path, target_paths):
    from safetensors.torch import load_file

    target = _tiny_target(tmp_path / "target", target_paths)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text("".join(
        json.dumps({"kind": "chat", "text": p, "source": "test"}) + "\n" for p in PROMPTS))
    job = _job(target, tmp_path, steps=0)
    arch = DraftArch(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=512,
                     init_from_target=True)
    out = run_distill(DistillJob(**{**job.__dict__, "arch": arch}), log=lambda m: None)
    draft, ref = load_file(str(out / "model.safetensors")), load_file(
        str(target / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.allclose(draft[name].float(), ref[name], atol=1e-3)
    kept = json.loads((out / DRAFT_VOCAB_FILE).read_text())["target_ids"]
    assert torch.allclose(draft["model.embed_tokens.weight"].float(),
                          ref["model.embed_tokens.weight"][kept], atol=1e-2)

    wrong = DraftArch(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=512,
                      init_from_target=True)
    with pytest.raises(ValueError, match="init-from-target"):
        run_distill(DistillJob(**{**job.__dict__, "arch": wrong}), log=lambda m: None)


def test_chat_prompt_set_is_added(tmp_path, target_paths):
    target = _tiny_target(tmp_path / "target", target_paths)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text("".join(
        json.dumps({"kind": "chat", "text": p, "source": "test"}) + "\n" for p in PROMPTS))
    job = _job(target, tmp_path, steps=3)
    chat = DataConfig(num_prompts=4, batch_size=4, max_new_tokens=8, kv_cache_mb=16,
                      mix="chat")
    out = run_distill(DistillJob(**{**job.__dict__, "chat_data": chat,
                                    "chat_data_dir": tmp_path / "chat"}), log=lambda m: None)
    card = json.loads((out / CARD_FILE).read_text())
    assert card["chat_data"]["sequences"] == 4 and card["chat_data"]["mix"] == "chat"
    assert card["data"]["sequences"] == len(PROMPTS) + 4  # totals over both sets


def test_missing_target_is_a_clear_cli_error(tmp_path, capsys):
    rc = main(["distill", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "d")])
    assert rc == 2
    assert "tandem: error:" in capsys.readouterr().err


def test_non_causal_target_is_refused(tmp_path, target_paths, capsys):
    target = _tiny_target(tmp_path / "enc", target_paths, architectures=["LlamaModel"])
    with pytest.raises(ModelError, match="not a causal language model"):
        check_target(str(target))
    rc = main(["distill", "--target", str(target), "--out", str(tmp_path / "d")])
    assert rc == 2 and "causal" in capsys.readouterr().err


def test_data_from_another_tokenizer_is_refused(tmp_path, target_paths):
    target = _tiny_target(tmp_path / "target", target_paths)
    data = tmp_path / "data"
    data.mkdir()
    (data / "target.json").write_text(json.dumps({"tokenizer_sha256": "0" * 64}))
    with pytest.raises(ModelError, match="different tokenizer"):
        run_distill(_job(target, tmp_path), log=lambda m: None)


def test_target_without_tokenizer_is_refused(tmp_path, target_paths):
    target = _tiny_target(tmp_path / "target", target_paths)
    (target / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="tokenizer"):
        check_target(str(target))


def test_help(capsys):
    for cmd in ("distill", "acceptance"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
    assert "--time-budget" in capsys.readouterr().out


def test_prompt_set_is_mostly_chat_and_mixes_sources():
    from tools.distill.corpus import AUSTEN_DB, build_prompts

    if not AUSTEN_DB.with_suffix(".rdb").is_file():
        pytest.skip("r-cran-janeaustenr is not installed")
    pytest.importorskip("rdata")
    prompts = build_prompts(200, seed=1)
    assert prompts == build_prompts(200, seed=1)  # deterministic: a resumed run sees the same
    chat = [p for p in prompts if p.kind == "chat"]
    assert len(chat) > 0.7 * len(prompts)
    assert {p.source for p in prompts} == {"austen", "code", "question"}


def test_chat_prompt_mix():
    from tools.distill.corpus import build_prompts

    prompts = build_prompts(50, seed=3, mix="chat")
    assert prompts == build_prompts(50, seed=3, mix="chat")
    assert all(p.kind == "chat" and p.source == "chat" for p in prompts)
    assert len({p.text for p in prompts}) > 40
    with pytest.raises(ValueError, match="mix"):
        build_prompts(5, seed=0, mix="nope")


def test_eagle_distill_generates_trains_resumes_and_serves(tmp_path, target_paths):
    """`tandem distill --method eagle` on a tiny target: features recorded while generating,
    a head trained and exported that the EagleProposer loads and drafts with; a second run
    with --resume reuses the shards and continues the training state."""
    from tandem.engine.eagle import EAGLE_CARD
    from tandem.models import ModelPaths
    from tandem.proposers.eagle import EagleProposer
    from tandem.spec import DraftRequest
    from tools.distill.eagle import load_feature_seqs

    target = _tiny_target(tmp_path / "target", target_paths)
    out, data = tmp_path / "head", tmp_path / "data"
    argv = ["distill", "--method", "eagle", "--target", str(target), "--out", str(out),
            "--data-dir", str(data), "--num-prompts", "8", "--gen-batch", "4",
            "--max-new-tokens", "12", "--eagle-vocab", "512", "--epochs", "2",
            "--batch-tokens", "256", "--time-budget", "0", "--heldout-prompts", "2"]
    assert main(argv) == 0
    seqs = load_feature_seqs(data)
    assert len(seqs) >= 4 and all(len(s.features) == len(s.ids) - 1 for s in seqs)
    card = json.loads((out / EAGLE_CARD).read_text())
    steps = card["progress"]["steps"]
    assert steps >= 1 and "--method eagle" in card["command"]
    # The trainer's figure on the held-out chat prompts too (greedy answers, 48 tokens each).
    held = card["progress"]["heldout_chat"]
    assert held["prompts"] == 2 and 2 <= held["positions"] <= 2 * 48
    assert 0 <= held["top1_step1"] <= 1
    head = EagleProposer.load(ModelPaths(out), 8 << 20)
    req = DraftRequest("k", seqs[0].ids[:6].tolist(), 6, 1, features=seqs[0].features[:5].float())
    (res,) = head.propose([req])
    assert len(res.tokens) == 1 and 0 <= res.tokens[0].token_id < 49152
    shards = {p: p.stat().st_mtime_ns for p in data.glob("shard-*.safetensors")}
    assert main([*argv, "--resume", "--epochs", "4"]) == 0
    assert {p: p.stat().st_mtime_ns for p in data.glob("shard-*.safetensors")} == shards
    assert json.loads((out / EAGLE_CARD).read_text())["progress"]["steps"] > steps
