"""`tandem distill --method eagle3`: train an EAGLE-3 head (tools.distill.eagle3_head) on the
distillation cache of `--method eagle`.

Features: EAGLE-3 drafts from three residual streams of the target (low, middle, high), not
the final hidden state the cache records while generating. `aux_features` adds them with one
teacher-forced pass over each cached conversation (a prefill: ~3x the generation's tokens
per second on a 2-core CPU), written beside its shard (`aux-shard-*.safetensors`), resumable.

Loss: EAGLE-3's, cross-entropy against the target's top-K distribution only (no feature
regression), at each of `ttt_steps` draft steps of the training-time test, step j weighted
ttt_decay**j.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.engine.block_manager import BlockManager
from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.eagle3 import capture_layers, default_layer_ids
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelPaths, read_hf_config
from tools.distill.airgap_head3 import ttt_terms
from tools.distill.config import EagleTrainConfig
from tools.distill.eagle import (
    FeatureSeq,
    Recipe,
    _batches,
    _to,
    aux_path,
    build_vocab,
    teacher_rows,
)
from tools.distill.eagle3_head import Eagle3TrainHead


def _conversations(shard: Path) -> list[list[int]]:
    """Each cached conversation's positions that ran (prompt + answer but its last token)."""
    with safe_open(str(shard), framework="pt") as f:  # not the shard's final features
        t = {k: f.get_tensor(k) for k in ("prompt_ids", "prompt_offsets", "gen_ids",
                                           "gen_offsets")}
    po, go = t["prompt_offsets"].tolist(), t["gen_offsets"].tolist()
    return [t["prompt_ids"][po[i]:po[i + 1]].tolist() + t["gen_ids"][go[i]:go[i + 1] - 1].tolist()
            for i in range(len(po) - 1)]


@torch.inference_mode()
def aux_features(runner: ModelRunner, data_dir: Path, max_tokens: int = 8192,
                 log=print) -> int:
    """Write every missing aux file of data_dir's shards: per conversation, [T, 3 x hidden]
    fp16, the runner's feature_layers at each position, rows laid out as the shard's
    `features`. Returns the positions computed."""
    shards = sorted(Path(data_dir).glob("shard-*.safetensors"))
    todo = [s for s in shards if not aux_path(s).exists()]
    log(f"eagle3: three-layer features cached for {len(shards) - len(todo)}/{len(shards)} "
        f"shards in {data_dir}")
    blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching=False)
    start, done = time.perf_counter(), 0
    for n, shard in enumerate(todo):
        convs = _conversations(shard)
        rows = [_prefill(runner, blocks, g) for g in _groups(convs, max_tokens, runner)]
        tmp = aux_path(shard).with_suffix(".tmp")
        save_file({"features": torch.cat(rows)}, str(tmp))
        tmp.rename(aux_path(shard))
        done += sum(len(c) for c in convs)
        rate = done / (time.perf_counter() - start)
        log(f"eagle3: {shard.name} ({n + 1}/{len(todo)}), {rate:.0f} positions/s, "
            f"ETA {(len(todo) - n - 1) * (time.perf_counter() - start) / (n + 1) / 60:.1f} min")
    return done


def _groups(convs: list[list[int]], max_tokens: int, runner: ModelRunner):
    """Consecutive conversations, up to max_tokens a forward and what the KV cache holds."""
    group, size, blocks = [], 0, 0
    for ids in convs:
        need = -(-len(ids) // runner.block_size)
        if group and (size + len(ids) > max_tokens or blocks + need > runner.num_blocks):
            yield group
            group, size, blocks = [], 0, 0
        group.append(ids)
        size, blocks = size + len(ids), blocks + need
    if group:
        yield group


def _prefill(runner: ModelRunner, blocks: BlockManager, group: list[list[int]]) -> torch.Tensor:
    chunks = []
    for j, ids in enumerate(group):
        blocks.allocate(f"aux-{j}", ids)
        chunks.append(SeqChunk(ids, 0, blocks.block_table(f"aux-{j}")))
    try:
        _, feats = runner.forward(chunks, with_hidden=True)
    finally:
        for j in range(len(group)):
            blocks.free(f"aux-{j}")
    return feats.to("cpu", torch.float16)


def aux_runner(model, kv_mb: int, layer_ids: tuple[int, ...] | None = None) -> ModelRunner:
    """The target whose features are the streams of `layer_ids` (EAGLE-3's default layers,
    which the verifier's `--eagle-feature-layers eagle3` sends, unless named)."""
    ids = layer_ids or default_layer_ids(model.cfg.num_layers)
    return ModelRunner.with_memory(model, kv_mb << 20, feature_layers=capture_layers(
        ids, model.cfg.num_layers))


def make_head3(target: ModelPaths, seqs: list[FeatureSeq], cfg: EagleTrainConfig,
               special: tuple[int, ...]) -> Eagle3TrainHead:
    """A head started from the target's layer cfg.init_layer, its LM head from the target's
    rows of the draft vocabulary (the cache's commonest tokens)."""
    lcfg = LlamaConfig.from_hf(read_hf_config(target))
    tensors = load_tensors(target)
    vocab = build_vocab(seqs, cfg.vocab, lcfg.vocab_size, special)
    embed = tensors["embed_tokens.weight"].float()
    head_w = embed if lcfg.tie_word_embeddings else tensors["lm_head.weight"].float()
    torch.manual_seed(cfg.seed)
    head = Eagle3TrainHead(lcfg, vocab, embed, head_w[torch.tensor(vocab.target_ids)],
                           default_layer_ids(lcfg.num_layers))
    head.init_from_target(tensors, cfg.init_layer % lcfg.num_layers)
    return head


def collate3(seqs: list[FeatureSeq], vocab, input_map: torch.Tensor):
    """Entries t = 1..T-1: token t, fused feature t-1 [B, n, 3h] and the teacher rows."""
    n = max(len(s.features) - 1 for s in seqs)
    feats = torch.zeros(len(seqs), n, seqs[0].features.shape[1])
    for i, s in enumerate(seqs):
        feats[i, :len(s.features) - 1] = s.features[:-1].float()
    ids, cls_mask, t_rows, t_probs = teacher_rows(seqs, vocab, input_map, n)
    return ids, feats, cls_mask, t_rows, t_probs


def losses3(head: Eagle3TrainHead, batch, cfg: EagleTrainConfig) -> dict:
    """Per draft step j (1-based): cross-entropy `clsj`, top-1 hits `hitj` of the teacher's
    greedy token over `nj` rows (airgap_head3.ttt_terms)."""
    out = {}
    for j, (ce, hit, n) in enumerate(ttt_terms(head, batch, cfg.ttt_steps), 1):
        out[f"cls{j}"], out[f"hit{j}"], out[f"n{j}"] = ce, hit, n
    return out


def total3(losses: dict, cfg: EagleTrainConfig) -> torch.Tensor:
    return sum(cfg.ttt_decay ** j * losses[f"cls{j + 1}"] for j in range(cfg.ttt_steps))


@torch.no_grad()
def evaluate3(head: Eagle3TrainHead, seqs: list[FeatureSeq], cfg: EagleTrainConfig) -> dict:
    """Teacher-forced agreement with the target's greedy token at each draft step."""
    head.eval()
    tot: dict[str, float] = {}
    device, input_map = head.fc.weight.device, head.vocab.input_map()
    for idx in _batches(seqs, cfg.batch_tokens, random.Random(0)):
        batch = _to(collate3([seqs[i] for i in idx], head.vocab, input_map), device)
        out = losses3(head, batch, cfg)
        for k, v in out.items():  # a step's mean cross-entropy counts by its rows
            w = float(out["n" + k[3:]]) if k.startswith("cls") else 1.0
            tot[k] = tot.get(k, 0.0) + float(v) * w
    head.train()
    n1 = max(tot.get("n1", 0.0), 1.0)
    out = {f"top1_step{j}": tot[f"hit{j}"] / max(tot[f"n{j}"], 1.0)
           for j in range(1, cfg.ttt_steps + 1)}
    return {**out, "ce_step1": tot["cls1"] / n1, "positions": int(tot["n1"])}


EAGLE3 = Recipe(collate3, losses3, total3, evaluate3, ("cls1", "cls2", "cls3"))
