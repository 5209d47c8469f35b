"""`--dtype auto` for a target on the CPU: the fastest path that keeps the checkpoint's weights.

A decode step streams every weight once, so its time is the bytes read. Weight-only int8 reads
~1.25 bytes per weight instead of fp32's 4 and runs 1.7-1.9x faster here
(docs/results/int8.md); where
every group of a weight already sits on a grid of at most 256 levels (a checkpoint converted
from 4- or 8-bit, as the default target is), its codes reproduce the float weights bit for bit.
So auto loads int8 when every weight is exact and the kernel builds, and float32 otherwise,
and says which at start-up.
"""
from __future__ import annotations

import logging

from kernels import int8_cpu
from tandem.device import Placement
from tandem.engine.llama import LlamaModel
from tandem.models import ModelPaths

log = logging.getLogger(__name__)


def load_target(paths: ModelPaths, at: Placement, batch_invariant: bool = False
                ) -> LlamaModel:
    """The target as `at` places it; under an auto dtype on the CPU, int8 when exact."""
    if not (at.auto_dtype and at.device.type == "cpu"):
        return LlamaModel.load(paths, at.dtype, batch_invariant=batch_invariant,
                               device=at.device)
    if int8_cpu.load() is None:
        log.info("dtype auto: float32 (the int8 kernel could not be built here)")
        return LlamaModel.load(paths, "float32", batch_invariant=batch_invariant)
    model = LlamaModel.load(paths, "int8", batch_invariant=batch_invariant)
    inexact = model.inexact_int8()
    if not inexact:
        log.info("dtype auto: int8 (every weight group of %s is exact in int8: the same "
                 "weights, a third of the bytes per decode step)", paths.root.name)
        return model
    log.info("dtype auto: float32 (%d weights of %s are not exact in int8, first %s)",
             len(inexact), paths.root.name, inexact[0])
    return LlamaModel.load(paths, "float32", batch_invariant=batch_invariant)
