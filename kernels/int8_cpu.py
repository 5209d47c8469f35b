"""The weight-only int8 CPU kernel (csrc/int8_gemm.cpp), compiled once per machine.

torch ships no fast int8-weight product for fp32 activations on CPU (its `_weight_int8pack_mm`
is scalar for fp32 and bf16-only when vectorised), so we build one: a small C++ extension
compiled on first use with -march=native (the machine that serves is the one that compiles)
into torch's extension cache (TORCH_EXTENSIONS_DIR). Needs a C++ compiler and ninja; without
them `load()` returns None and callers fall back to dequantize-then-GEMM (correct, slower).
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_gemm.cpp"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU wheel (the pragma is inert without it);
# the extension then shares the libgomp.so.1 that torch has already loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def load():
    """The compiled module (with `int8_gemm`), or None where it cannot be built."""
    if os.environ.get("TANDEM_INT8_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension("tandem_int8_gemm", [str(_SOURCE)], extra_cflags=_FLAGS,
                              extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, no headers: the fallback still works
        log.warning("int8 CPU kernel unavailable (%s): int8 weights will be dequantized per "
                    "product, which is slower than fp32", str(exc).splitlines()[0][:200])
        return None
