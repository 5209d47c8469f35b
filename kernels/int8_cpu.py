"""The weight-only int8 CPU kernel (csrc/int8_gemm.cpp), compiled once per machine
(kernels/cpu_ext.py).

torch ships no fast int8-weight product for fp32 activations on CPU (its `_weight_int8pack_mm`
is scalar for fp32 and bf16-only when vectorised), so we build one. Without a compiler
`load()` returns None and callers fall back to dequantize-then-GEMM (correct, slower).
"""
from __future__ import annotations

import functools
import os

from kernels import cpu_ext

_SOURCE = cpu_ext.CSRC / "int8_gemm.cpp"
_NAME = "tandem_int8_gemm"


@functools.cache
def load():
    """The compiled module (with `int8_gemm`), or None where it cannot be built."""
    if os.environ.get("TANDEM_INT8_KERNEL", "1") == "0":
        return None
    return cpu_ext.build(_NAME, _SOURCE, "int8 weights will be dequantized per product, "
                         "which is slower than fp32")


def build_key() -> str:
    """A digest of everything the compiled binary depends on, and of nothing path-like."""
    return cpu_ext.build_key(_SOURCE)
