"""The weight-only int8 CPU kernels, compiled once per machine (kernels/cpu_ext.py):

- csrc/int8_gemm.cpp (`--dtype int8`): fp32 activations. torch ships no fast int8-weight
  product for fp32 activations on CPU (its `_weight_int8pack_mm` is scalar for fp32 and
  bf16-only when vectorised), so we build one. Without a compiler `load()` returns None and
  callers fall back to dequantize-then-GEMM (correct, slower).
- csrc/int8_bf16_gemm.cpp (`--dtype int8-bf16`): activations rounded to bf16, twice the
  products per instruction on CPUs with AVX512-BF16. No fallback: its numbers are its own.
"""
from __future__ import annotations

import functools
import os

from kernels import cpu_ext

_SOURCE = cpu_ext.CSRC / "int8_gemm.cpp"
_NAME = "tandem_int8_gemm"
_BF16_SOURCE = cpu_ext.CSRC / "int8_bf16_gemm.cpp"
_BF16_NAME = "tandem_int8_bf16_gemm"


@functools.cache
def load():
    """The compiled module (with `int8_gemm`), or None where it cannot be built."""
    if os.environ.get("TANDEM_INT8_KERNEL", "1") == "0":
        return None
    return cpu_ext.build(_NAME, _SOURCE, "int8 weights will be dequantized per product, "
                         "which is slower than fp32")


@functools.cache
def load_bf16():
    """The compiled module (with `int8_bf16_gemm`), or None where it cannot be built or this
    CPU has no AVX512-BF16."""
    module = cpu_ext.build(_BF16_NAME, _BF16_SOURCE, "--dtype int8-bf16 is unavailable")
    return module if module is not None and module.available() else None


def build_key() -> str:
    """A digest of everything the compiled binary depends on, and of nothing path-like."""
    return cpu_ext.build_key(_SOURCE)
