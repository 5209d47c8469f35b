"""Air-gapped EAGLE training end to end on a tiny target: `tandem distill bundle` (parts of
1 MiB), the stand-alone script in a fresh interpreter that cannot import tandem (returned
parts of 20 KiB), `tandem distill unbundle`, and the real EagleProposer drafting with the
result; a rerun of the script continues the training."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distill import _tiny_target

from tandem.models import ModelPaths, tokenizer_hash
from tools.cli import main

pytestmark = pytest.mark.integration

RETURN_MIB = 0.02


def _script(bundle: Path, out: Path, device: str, *args: str) -> subprocess.CompletedProcess:
    """airgap_train.py as on the CUDA box: its own process, run from the bundle, with a
    `tandem` and a `tools` package on the path that fail to import."""
    poison = out.parent / "poison"
    for pkg in ("tandem", "tools"):
        (poison / pkg).mkdir(parents=True, exist_ok=True)
        (poison / pkg / "__init__.py").write_text("raise ImportError('not on the CUDA box')\n")
    env = {**os.environ, "PYTHONPATH": str(poison), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "airgap_train.py", "--device", device, "--out", str(out),
         "--gen-batch", "8", "--vocab", "512", "--batch-tokens", "512",
         "--part-mib", str(RETURN_MIB), *args],
        cwd=bundle, env=env, capture_output=True, text=True, timeout=180)


def _bundle(tmp_path: Path, target: Path) -> Path:
    out = tmp_path / "bundle"
    assert main(["distill", "bundle", "--out", str(out), "--target", str(target),
                 "--prompts", "24", "--part-mib", "1", "--minutes", "1",
                 "--max-new-tokens", "12"]) == 0
    files = [p for p in out.rglob("*") if p.is_file()]
    assert max(p.stat().st_size for p in files) <= 1 << 20
    manifest = json.loads((out / "files" / "manifest.json").read_text())
    weights = next(f for f in manifest["files"] if f["name"] == "model.safetensors")
    assert len(weights["parts"]) >= 5  # ~6.4 MB of tiny target in 1 MiB parts
    assert {"airgap_train.py", "airgap_parts.py", "airgap_data.py", "airgap_head.py",
            "airgap_head3.py", "airgap_fit.py", "bundle.json", "README.txt"} <= \
        {p.name for p in files}
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bundle_train_unbundle_and_draft(tmp_path, target_paths, device):
    from tandem.proposers.eagle import EagleProposer
    from tandem.spec import DraftRequest
    from tools.distill.airgap_train import load_seqs

    target = _tiny_target(tmp_path / "target", target_paths)
    bundle, out = _bundle(tmp_path, target), tmp_path / "work"
    run = _script(bundle, out, device, "--epochs", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[train]" in run.stderr and "ETA" in run.stderr

    ret = out / "return"
    parts = [p for p in ret.iterdir() if p.name != "manifest.json"]
    assert max(p.stat().st_size for p in parts) <= RETURN_MIB * (1 << 20)
    assert len([p for p in parts if p.name.startswith("model.safetensors.part")]) >= 2
    figures = json.loads((ret / "figures.json").read_text())
    assert figures["train"]["steps"] >= 1 and figures["train"]["positions_trained"] > 0
    held = figures["heldout_by_conversation"]
    assert held["positions"] > 0 and 0 <= held["top1_step1"] <= 1
    assert figures["data"]["heldout_answers"] == 1 and figures["data"]["train_answers"] >= 16
    # The teacher-forced pass reproduces the greedy answers: the features are the final
    # normed hidden states the LM head reads.
    assert figures["data"]["teacher_agrees_with_greedy_answers"] >= 0.9

    head_dir = tmp_path / "head"
    assert main(["distill", "unbundle", "--head-dir", str(ret), "--out", str(head_dir)]) == 0
    assert tokenizer_hash(ModelPaths(head_dir)) == tokenizer_hash(ModelPaths(target))
    proposer = EagleProposer.load(ModelPaths(head_dir), 8 << 20)
    seq = load_seqs(out / "data")[0]
    req = DraftRequest("k", seq.ids[:6].tolist(), 6, 1, features=seq.features[:5].float())
    (res,) = proposer.propose([req])
    assert len(res.tokens) == 1 and 0 <= res.tokens[0].token_id < 49152

    # A rerun keeps the shards and continues the training state.
    shards = {p: p.stat().st_mtime_ns for p in (out / "data").glob("shard-*")}
    rerun = _script(bundle, out, device, "--epochs", "4")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed at step" in rerun.stderr
    assert {p: p.stat().st_mtime_ns for p in (out / "data").glob("shard-*")} == shards
    again = json.loads((ret / "figures.json").read_text())
    assert again["train"]["steps"] > figures["train"]["steps"]


def test_eagle3_bundle_trains_a_head_that_serves_what_it_measured(tmp_path, target_paths):
    """--method eagle3: the script records three layers' outputs (the rows tandem's runner
    sends the draft worker), trains with the training-time test, and the returned head in the
    published EAGLE-3 layout drafts through the real proposer with the agreement the
    script's own validation computes."""
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import SeqChunk
    from tandem.proposers.eagle import EagleProposer
    from tools.distill.airgap_fit import evaluate
    from tools.distill.airgap_train import load_seqs, parse
    from tools.distill.eagle3 import aux_runner
    from tools.distill.eagle3_head import Eagle3TrainHead
    from tools.distill.eagle_agreement import served_top1

    target = _tiny_target(tmp_path / "target", target_paths, layers=8)
    bundle, out = tmp_path / "bundle", tmp_path / "work"
    assert main(["distill", "bundle", "--out", str(bundle), "--target", str(target),
                 "--prompts", "16", "--minutes", "1", "--max-new-tokens", "12",
                 "--method", "eagle3"]) == 0
    assert json.loads((bundle / "bundle.json").read_text())["eagle3_layer_ids"] == [1, 3, 4]
    run = _script(bundle, out, "cpu", "--epochs", "2", "--ttt-steps", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads((out / "return" / "figures.json").read_text())
    assert set(figures["heldout_by_conversation"]) >= {"top1_step1", "top1_step2"}

    seqs = load_seqs(out / "data")
    runner = aux_runner(LlamaModel.load(ModelPaths(target)), 16)
    for s in seqs[:3]:  # the HF pass's rows are the verifier's three streams
        ids = s.ids[:-1].tolist()
        _, feats = runner.forward([SeqChunk(ids, 0, list(range(-(-len(ids) // 16))))],
                                  with_hidden=True)
        assert s.features.shape == (len(ids), 96)
        torch.testing.assert_close(s.features.float(), feats.float(), atol=3e-3, rtol=3e-3)

    head_dir = tmp_path / "head"
    assert main(["distill", "unbundle", "--head-dir", str(out / "return"), "--out",
                 str(head_dir), "--target", str(target)]) == 0
    prop = EagleProposer.load(ModelPaths(head_dir), 8 << 20, target=ModelPaths(target))
    cfg, _ = parse(["--bundle", str(bundle), "--out", str(out), "--ttt-steps", "2"])
    trained = evaluate(Eagle3TrainHead.from_export(head_dir, ModelPaths(target)), seqs[:4], cfg)
    served = served_top1(prop, seqs[:4])
    assert served["positions"] == trained["positions"] > 0
    assert served["served"] == pytest.approx(trained["top1_step1"], abs=1e-4)
    # Another method on the same work dir is refused (its shards hold other features).
    again = _script(bundle, out, "cpu", "--method", "eagle")
    assert again.returncode == 2 and "started with --method eagle3" in again.stderr
