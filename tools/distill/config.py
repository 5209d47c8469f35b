"""The distillation jobs' configuration: plain frozen dataclasses without torch, so that
`tandem distill --help` builds its flags (and their defaults) without loading torch."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.sampling_params import SamplingParams

GEN_DTYPES = ("auto", "bfloat16", "float32", "float16")  # the target's while generating
PROMPT_MIXES = ("corpus", "chat", "self")


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 3000
    batch_size: int = 16
    max_new_tokens: int = 160
    max_prompt_tokens: int = 256
    top_k: int = 32  # teacher log-probs kept per position
    sampled_every: int = 3  # every n-th shard samples at temperature; the rest are greedy
    temperature: float = 0.7
    seed: int = 0
    kv_cache_mb: int = 1024
    # bf16 generates ~4x faster on CPUs with AVX512-BF16 and its greedy tokens agree with
    # fp32 on 98.8% of positions (KL 6e-4 nats), so the teacher barely changes. "auto" is the
    # device's (tandem.device: float32 on the cpu, bfloat16 on a GPU), resolved by `placed`.
    dtype: str = "bfloat16"
    # prompt set: "corpus" (Austen / code / questions), "chat" (task x subject grid) or
    # "self" (requests the target writes itself, tools.distill.self_prompts)
    mix: str = "corpus"
    # Also keep the target's final normed hidden state of every position (fp16), for EAGLE
    # heads: they come out of the generating forwards for free.
    features: bool = False

    def __post_init__(self):
        for name in ("num_prompts", "batch_size", "max_new_tokens", "max_prompt_tokens",
                     "top_k", "sampled_every", "kv_cache_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.mix not in PROMPT_MIXES:
            raise ValueError(f"the prompt mix must be one of {', '.join(PROMPT_MIXES)}, got "
                             f"{self.mix!r}")
        if self.dtype not in GEN_DTYPES:
            raise ValueError(f"the data's dtype must be one of {', '.join(GEN_DTYPES)}, got "
                             f"{self.dtype!r}")

    @property
    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved on a device first (data.placed)")
        return getattr(torch, self.dtype)

    def shard_params(self, shard: int) -> SamplingParams:
        if shard % self.sampled_every == self.sampled_every - 1:
            return SamplingParams(temperature=self.temperature, seed=self.seed * 100003 + shard)
        return SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class DraftArch:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    vocab: int = 8192  # kept target tokens; 0 = the target's full vocabulary
    # Start from the target's own first `layers` layers, norm and (kept) embedding rows: an
    # early-exit copy of the target learns far faster than a random draft on little data.
    init_from_target: bool = False
    # Keep the embedding (= tied output head) fixed: with little data, training it overfits
    # the rows of tokens the data happens to contain.
    freeze_embeddings: bool = False

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must divide by heads {self.heads}, and "
                             f"heads by kv_heads {self.kv_heads}")
        if self.vocab < 0:
            raise ValueError(f"--draft-vocab must be >= 0, got {self.vocab}")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    time_budget_min: float = 0.0  # 0 = no limit; else the LR schedule ends at the budget
    batch_tokens: int = 4096  # padded tokens per batch
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    ce_weight: float = 0.1  # cross-entropy on the generated token, added to the KL
    seed: int = 0
    checkpoint_min: float = 5.0  # minutes between checkpoints (and exports)
    bf16: bool = True  # autocast matmuls to bf16: ~3.7x faster on AVX512-BF16 CPUs

    def __post_init__(self):
        if self.steps < 0 or self.batch_tokens < 16 or self.lr <= 0 or self.warmup < 0:
            raise ValueError("need steps >= 0, batch_tokens >= 16, lr > 0, warmup >= 0")
        if self.time_budget_min < 0 or self.ce_weight < 0 or self.checkpoint_min <= 0:
            raise ValueError("need time_budget >= 0, ce_weight >= 0, checkpoint_min > 0")


@dataclass(frozen=True)
class EagleTrainConfig:
    vocab: int = 8192  # truncated draft vocabulary (most frequent target tokens)
    init_layer: int = -1  # the target layer the head starts from (-1 = last)
    time_budget_min: float = 20.0
    epochs: float = 4.0
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup: int = 50
    cls_weight: float = 0.5  # weight of the token loss against the feature regression
    step2_weight: float = 0.5  # weight of the second draft step's losses (0 = off)
    val_fraction: float = 0.04
    checkpoint_min: float = 4.0
    seed: int = 0
    # EAGLE-3 only: draft steps of the training-time test, step j's loss weighted decay**j.
    ttt_steps: int = 3
    ttt_decay: float = 0.8

    def __post_init__(self):
        if not 1 <= self.ttt_steps <= 8 or not 0 < self.ttt_decay <= 1:
            raise ValueError(f"need 1 <= ttt_steps <= 8 and 0 < ttt_decay <= 1, got "
                             f"{self.ttt_steps}, {self.ttt_decay}")
        if self.vocab < 16 or self.batch_tokens < 64 or self.lr <= 0 or self.epochs <= 0:
            raise ValueError("need vocab >= 16, batch_tokens >= 64, lr > 0, epochs > 0")
        if not 0 <= self.val_fraction < 1 or self.checkpoint_min <= 0:
            raise ValueError("need 0 <= val_fraction < 1 and checkpoint_min > 0")


@dataclass(frozen=True)
class MedusaTrainConfig:
    num_heads: int = 4
    num_layers: int = 1
    vocab: int = 8192
    tree_size: int = 16  # nodes in the exported default tree
    time_budget_min: float = 20.0
    epochs: float = 2.0
    batch_positions: int = 1024
    lr: float = 1e-3
    warmup: int = 50
    teacher_top_k: int = 8
    val_fraction: float = 0.04
    checkpoint_min: float = 4.0
    seed: int = 0

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1 or self.vocab < 16 or self.tree_size < 1:
            raise ValueError("need num_heads, num_layers, tree_size >= 1 and vocab >= 16")
        if self.batch_positions < 16 or self.lr <= 0 or self.epochs <= 0:
            raise ValueError("need batch_positions >= 16, lr > 0, epochs > 0")
        if not 0 <= self.val_fraction < 1 or self.checkpoint_min <= 0:
            raise ValueError("need 0 <= val_fraction < 1 and checkpoint_min > 0")
