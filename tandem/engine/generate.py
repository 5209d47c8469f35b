"""Plain (non-speculative) batched decoding with our runner and block manager.

The main job's first form (`tandem generate`), the reference the tests compare with
`transformers`, and the "our runner" line of the benchmarks. The verifier's engine loop reuses
the same pieces with a scheduler in front.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.sampling import keyed_seed, logits_to_probs, make_generator, sample
from tandem.engine.block_manager import BlockManager
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams


@dataclass
class _Seq:
    session_id: str
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    done: bool = False


class LocalGenerator:
    """Decodes a batch of prompts together: one flattened forward per step."""

    def __init__(self, runner: ModelRunner, prefix_caching: bool = True):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        max_new_tokens: int,
        stop_token_ids: tuple[int, ...] = (),
        on_step=None,
    ) -> list[list[int]]:
        """New tokens per prompt (a stop token, if hit, is included and ends the sequence)."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("generate needs at least one non-empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        seqs = [_Seq(f"local-{i}", list(p)) for i, p in enumerate(prompts)]
        seeds = [None if params.seed is None else params.seed + i for i in range(len(seqs))]
        try:
            logits = self._prefill(seqs)
            for _ in range(max_new_tokens):
                active = [s for s in seqs if not s.done]
                # Seeded: the noise of each position keyed by (seed, position), as the
                # verifier draws it, so `tandem generate --seed S` gives the server's text.
                gens = [None if (seed := seeds[seqs.index(s)]) is None else
                        make_generator(keyed_seed(seed, len(s.prompt) + len(s.generated)))
                        for s in active]
                tokens = self._sample(logits, params, gens)
                for s, tok in zip(active, tokens):
                    s.generated.append(tok)
                    s.done = tok in stop_token_ids or len(s.generated) >= max_new_tokens
                if on_step is not None:
                    on_step(len(active))
                still = [s for s in active if not s.done]
                if not still:
                    break
                logits = self._decode(still)
        finally:
            for s in seqs:
                if self.blocks.has(s.session_id):
                    self.blocks.free(s.session_id)
        return [s.generated for s in seqs]

    def _prefill(self, seqs: list[_Seq]) -> torch.Tensor:
        chunks = []
        for s in seqs:
            cached = self.blocks.allocate(s.session_id, s.prompt)
            table = self.blocks.block_table(s.session_id)
            chunks.append(SeqChunk(s.prompt[cached:], cached, table))
        logits = self._forward(chunks)
        for s in seqs:
            self.blocks.commit(s.session_id, len(s.prompt))
        return logits

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        chunks = []
        for s in seqs:
            start = self.blocks.num_tokens(s.session_id)
            self.blocks.append(s.session_id, [s.generated[-1]])
            chunks.append(SeqChunk([s.generated[-1]], start, self.blocks.block_table(s.session_id)))
        logits = self._forward(chunks)
        for s in seqs:
            self.blocks.commit(s.session_id, self.blocks.num_tokens(s.session_id))
        return logits

    def _forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """One forward (a hook: data recorders also keep the hidden states)."""
        return self.runner.forward(chunks)

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, gens) -> list[int]:
        if params.is_greedy:
            return logits.argmax(-1).tolist()
        n = logits.shape[0]
        probs = logits_to_probs(
            logits,
            torch.full((n,), params.temperature, dtype=torch.float32),
            torch.full((n,), params.top_k, dtype=torch.int64),
            torch.full((n,), params.top_p, dtype=torch.float32),
        )
        return sample(probs, gens).tolist()
