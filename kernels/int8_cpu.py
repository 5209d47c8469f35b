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
import time
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_gemm.cpp"
_NAME = "tandem_int8_gemm"
_STALE_LOCK_S = 600  # a build takes ~1-2 min; an older lock is from a process that died
# -fopenmp: at::parallel_for is OpenMP in torch's CPU wheel (the pragma is inert without it);
# the extension then shares the libgomp.so.1 that torch has already loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def load():
    """The compiled module (with `int8_gemm`), or None where it cannot be built."""
    if os.environ.get("TANDEM_INT8_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        _clear_stale_lock(Path(_get_build_directory(_NAME, verbose=False)))
        return load_extension(_NAME, [str(_SOURCE)], extra_cflags=_FLAGS,
                              extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, no headers: the fallback still works
        log.warning("int8 CPU kernel unavailable (%s): int8 weights will be dequantized per "
                    "product, which is slower than fp32", str(exc).splitlines()[0][:200])
        return None


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's build lock outlives a process killed mid-build, and the next load would wait on
    it forever."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass
