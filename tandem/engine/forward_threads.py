"""How many CPU threads a forward runs on, chosen by its row count.

A forward of a few rows (a decode step of a few sessions, a short verify round) is bound by
memory, not arithmetic, and in a serving process it shares the cores with the event loop,
gRPC and the gateway: there it runs faster on one thread than on two. A forward of many
rows (a prefill, a long verify round, a batch of sessions) is bound by arithmetic and runs
up to twice as fast on two. Measured through the gateway on the default target, 2 cores
(docs/results/forward-threads-2026-11-29.md): from 6 rows on all threads, below on one,
copy-rich asks ran 1.34x faster with ngram, plain 1.03-1.16x, against one thread always.

Only where the thread count cannot change a bit of the logits: our int8 kernels and the
CPU attention kernel split their work over output channels and rows only, never over a
sum (kernels/csrc). A BLAS may split a sum over threads, so float weights keep one count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import attention_cpu
from tandem.engine.layer_weights import named_projections
from tandem.engine.linear import QUANTIZED


@dataclass(frozen=True)
class ForwardThreads:
    wide: int  # threads for a forward of at least wide_rows rows
    narrow: int = 1  # threads for a forward of fewer rows
    wide_rows: int = 6

    def __post_init__(self):
        if self.wide < 1 or self.narrow < 1 or self.wide_rows < 1:
            raise ValueError(f"forward threads must be >= 1 and wide_rows >= 1, got "
                             f"wide={self.wide}, narrow={self.narrow}, "
                             f"wide_rows={self.wide_rows}")

    def for_rows(self, rows: int) -> int:
        return self.wide if rows >= self.wide_rows else self.narrow

    def apply(self, rows: int) -> None:
        """Set the calling thread's torch threads for a forward of `rows` rows (a no-op
        when already so: set_num_threads reconfigures OpenMP)."""
        want = self.for_rows(rows)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


def thread_invariant(model) -> bool:
    """Whether `model`'s logits are the same bits at any thread count: every projection and
    the LM head our int8 kernels, attention our CPU kernel."""
    cfg = model.cfg
    if (model.device.type != "cpu" or not attention_cpu.takes(model.dtype, cfg.head_dim)
            or cfg.sliding_window or cfg.attn_softcap):  # those attend in torch
        return False
    return all(isinstance(w, QUANTIZED)
               for _, w in named_projections(model.layers, model.lm_head))
