"""Distillation data: text the target generates for the prompt set, with the target's top-K
log-probs at every generated position, cached on disk in resumable shards.

Why capture the teacher distribution during generation: the logits the target computes to
sample token t ARE the teacher distribution at t, so no second, teacher-forced target pass is
needed (on 2 CPU cores that pass would cost about as much as generating).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tandem.device import Placement, place
from tandem.engine.generate import LocalGenerator
from tools.distill.config import DataConfig
from tools.distill.corpus import Prompt, build_prompts, encode_prompt


class _RecordingGenerator(LocalGenerator):
    """LocalGenerator that keeps the top-K log-probs of every distribution it samples from
    and, with features=True, the hidden state of every position it runs (prefix caching off,
    so every prompt position is computed)."""

    def __init__(self, runner, top_k: int, features: bool = False):
        super().__init__(runner, prefix_caching=not features)
        self.top_k = top_k
        self.features = features
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.hidden: list[torch.Tensor] = []  # per forward: [rows, hidden] fp16

    def _forward(self, chunks):
        if not self.features:
            return super()._forward(chunks)
        logits, hidden = self.runner.forward(chunks, with_hidden=True)
        # Kept on the CPU (where the shard is written), not piling up in GPU memory.
        self.hidden.append(hidden.to(device="cpu", dtype=torch.float16))
        return logits

    def _sample(self, logits, params, gens):  # overrides the parent's staticmethod
        vals, ids = logits.float().log_softmax(-1).topk(self.top_k, dim=-1)
        self.steps.append((ids.to(device="cpu", dtype=torch.int32),
                           vals.to(device="cpu", dtype=torch.float16)))
        return LocalGenerator._sample(logits, params, gens)


def _per_position(steps, gen_lens: list[int]):
    """Regroup per-step rows into per-sequence rows: at step t the rows are, in order, the
    sequences that generated more than t tokens (LocalGenerator drops finished ones)."""
    per_seq_ids = [[] for _ in gen_lens]
    per_seq_lp = [[] for _ in gen_lens]
    for t, (ids, lps) in enumerate(steps):
        active = [i for i, n in enumerate(gen_lens) if n > t]
        for row, i in enumerate(active):
            per_seq_ids[i].append(ids[row])
            per_seq_lp[i].append(lps[row])
    ids = torch.stack([r for seq in per_seq_ids for r in seq])
    lps = torch.stack([r for seq in per_seq_lp for r in seq])
    return ids, lps


def _features_per_sequence(hidden: list[torch.Tensor], prompt_lens: list[int],
                           gen_lens: list[int]) -> torch.Tensor:
    """[sum(len(prompt) + len(gen) - 1), hidden]: per sequence, the state of every position
    that was run (the last generated token never is). hidden[0] is the prefill (all prompt
    rows, in order); hidden[t] is decode step t, one row per sequence still running."""
    per_seq: list[list[torch.Tensor]] = []
    at = 0
    for n in prompt_lens:
        per_seq.append([hidden[0][at:at + n]])
        at += n
    for t, rows in enumerate(hidden[1:]):
        active = [i for i, g in enumerate(gen_lens) if g > t + 1]
        for row, i in enumerate(active):
            per_seq[i].append(rows[row:row + 1])
    return torch.cat([torch.cat(p) for p in per_seq])


def _flat(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([0] + [len(s) for s in seqs])
    return torch.tensor([t for s in seqs for t in s], dtype=torch.int32), lens.cumsum(0)


def generate_shard(gen: _RecordingGenerator, prompts: list[list[int]], params, cfg: DataConfig,
                   stop: tuple[int, ...], path: Path) -> int:
    """Generate one batch and write it atomically; returns the number of generated tokens."""
    gen.steps, gen.hidden = [], []
    outs = gen.generate(prompts, params, cfg.max_new_tokens, stop)
    topk_ids, topk_lp = _per_position(gen.steps, [len(o) for o in outs])
    p_flat, p_off = _flat(prompts)
    g_flat, g_off = _flat(outs)
    tensors = {"prompt_ids": p_flat, "prompt_offsets": p_off, "gen_ids": g_flat,
               "gen_offsets": g_off, "topk_ids": topk_ids, "topk_logprobs": topk_lp}
    if gen.features:
        tensors["features"] = _features_per_sequence(
            gen.hidden, [len(p) for p in prompts], [len(o) for o in outs])
        gen.hidden = []
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"temperature": str(params.temperature),
                                               "dtype": cfg.dtype})
    tmp.rename(path)  # a shard either exists whole or not at all: restarts resume cleanly
    return int(g_flat.numel())


def placed(cfg: DataConfig, device: str = "auto") -> tuple[Placement, DataConfig]:
    """Where the target generates (`device`: auto, cpu, cuda, cuda:N) and cfg with its dtype
    resolved there ("auto" -> the device's), as the shards and the model card record it."""
    at = place(device, cfg.dtype)
    return at, (cfg if cfg.dtype == at.dtype else replace(cfg, dtype=at.dtype))


def target_runner(paths, cfg: DataConfig, at: Placement):
    """The target on `at`, in cfg's dtype, with cfg's KV cache: what generate_dataset runs."""
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import ModelRunner

    model = LlamaModel.load(paths, cfg.torch_dtype, device=at.device)
    return ModelRunner.with_memory(model, cfg.kv_cache_mb << 20, at.block_size)


def generate_dataset(target_root: Path, tokenizer, runner, cfg: DataConfig, data_dir: Path,
                     log=print, deadline: float | None = None,
                     part: tuple[int, int] = (0, 1)) -> None:
    """Generate every missing shard of the prompt set into data_dir (resumable). With
    part=(i, n), only shards s with s % n == i: n processes can fill one cache together."""
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts = _load_or_build_prompts(data_dir, cfg, runner, tokenizer, deadline)
    stop = tuple(t for t in [tokenizer.eos_token_id] if t is not None)
    gen = _RecordingGenerator(runner, cfg.top_k, cfg.features)
    num_shards = -(-len(prompts) // cfg.batch_size)
    mine = [s for s in range(num_shards) if s % part[1] == part[0]]
    todo = [s for s in mine if not _shard_path(data_dir, s).exists()]
    log(f"data: {len(mine) - len(todo)}/{len(mine)} shards cached in {data_dir}")
    start, tokens = time.perf_counter(), 0
    for n, s in enumerate(todo):
        if deadline is not None and time.time() > deadline:
            log("data: generation time budget reached; training on the shards so far")
            break
        batch = prompts[s * cfg.batch_size:(s + 1) * cfg.batch_size]
        ids = [encode_prompt(tokenizer, p, cfg.max_prompt_tokens) for p in batch]
        tokens += generate_shard(gen, ids, cfg.shard_params(s), cfg, stop,
                                 _shard_path(data_dir, s))
        rate = tokens / (time.perf_counter() - start)
        log(f"data: shard {s} done ({n + 1}/{len(todo)} this run, {rate:.0f} gen tok/s)")


def _shard_path(data_dir: Path, shard: int) -> Path:
    return data_dir / f"shard-{shard:05d}.safetensors"


def _load_or_build_prompts(data_dir: Path, cfg: DataConfig, runner=None, tokenizer=None,
                           deadline: float | None = None) -> list[Prompt]:
    """The prompt set is written once; a resumed run must see the very same prompts. The
    "self" mix is sampled from the target first (its own resumable cache)."""
    path = data_dir / "prompts.jsonl"
    if path.exists():
        prompts = [Prompt(**json.loads(line)) for line in path.read_text().splitlines()]
        if len(prompts) >= cfg.num_prompts:
            return prompts[:cfg.num_prompts]
    if cfg.mix == "self":
        from tandem.engine.generate import LocalGenerator
        from tools.distill.self_prompts import self_prompts

        prompts = self_prompts(LocalGenerator(runner), tokenizer, cfg.num_prompts, cfg.seed,
                               data_dir / "self_prompts.jsonl", cfg.batch_size, deadline)
        if len(prompts) < cfg.num_prompts:  # out of time: answer the whole batches so far
            return prompts[:len(prompts) // cfg.batch_size * cfg.batch_size]
    else:
        prompts = build_prompts(cfg.num_prompts, cfg.seed, mix=cfg.mix)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p.__dict__) + "\n" for p in prompts))
    tmp.rename(path)
    return prompts


@dataclass(frozen=True)
class Example:
    """One training sequence: prompt + generated ids, teacher top-K for the generated part."""

    ids: torch.Tensor  # [prompt + gen] int64
    gen_start: int  # index in ids of the first generated token
    topk_ids: torch.Tensor  # [gen, K] int64, teacher distribution predicting ids[gen_start + j]
    topk_logprobs: torch.Tensor  # [gen, K] float32
    sampled: bool


def load_examples(data_dir: Path, cfg: DataConfig | None = None) -> list[Example]:
    """The cached shards of cfg's prompt set (every shard if cfg is None), as sequences."""
    out = []
    paths = sorted(data_dir.glob("shard-*.safetensors"))
    if cfg is not None:  # shards past num_prompts belong to a larger run: leave them out
        num_shards = -(-cfg.num_prompts // cfg.batch_size)
        paths = [p for s in range(num_shards) if (p := _shard_path(data_dir, s)).exists()]
    for path in paths:
        t = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            sampled = float(f.metadata()["temperature"]) > 0
        po, go = t["prompt_offsets"].tolist(), t["gen_offsets"].tolist()
        for i in range(len(po) - 1):
            prompt = t["prompt_ids"][po[i]:po[i + 1]].long()
            gen = t["gen_ids"][go[i]:go[i + 1]].long()
            out.append(Example(torch.cat([prompt, gen]), len(prompt),
                               t["topk_ids"][go[i]:go[i + 1]].long(),
                               t["topk_logprobs"][go[i]:go[i + 1]].float(), sampled))
    return out


def data_stats(examples: list[Example]) -> dict:
    return {"sequences": len(examples),
            "prompt_tokens": sum(e.gen_start for e in examples),
            "generated_tokens": sum(len(e.ids) - e.gen_start for e in examples),
            "sampled_sequences": sum(e.sampled for e in examples)}


def main(argv=None) -> None:
    """Data only: `python -m tools.distill.data TARGET DATA_DIR [N [MINUTES [I/PARTS]]]` (the
    same DataConfig defaults as `tandem distill`; run PARTS processes to use more cores; the
    target on $TANDEM_DISTILL_DEVICE, default auto)."""
    from transformers import AutoTokenizer

    from tandem.envflags import env
    from tandem.models import resolve_model

    argv = sys.argv[1:] if argv is None else argv
    paths = resolve_model(argv[0])
    at, cfg = placed(DataConfig(num_prompts=int(argv[2]) if len(argv) > 2 else 3000,
                                mix=argv[5] if len(argv) > 5 else "corpus",
                                dtype=env("TANDEM_DISTILL_DTYPE", DataConfig.dtype)),
                     env("TANDEM_DISTILL_DEVICE", "auto"))
    runner = target_runner(paths, cfg, at)
    tok = AutoTokenizer.from_pretrained(str(paths.root))
    deadline = time.time() + 60 * float(argv[3]) if len(argv) > 3 else None
    part = tuple(int(x) for x in argv[4].split("/")) if len(argv) > 4 else (0, 1)
    generate_dataset(paths.root, tok, runner, cfg, Path(argv[1]), deadline=deadline, part=part)


if __name__ == "__main__":
    main()
