"""The weight-only int8 CPU kernel (csrc/int8_gemm.cpp), compiled once per machine.

torch ships no fast int8-weight product for fp32 activations on CPU (its `_weight_int8pack_mm`
is scalar for fp32 and bf16-only when vectorised), so we build one: a small C++ extension
compiled on first use with -march=native (the machine that serves is the one that compiles)
into torch's extension cache (TORCH_EXTENSIONS_DIR). Needs a C++ compiler and ninja; without
them `load()` returns None and callers fall back to dequantize-then-GEMM (correct, slower).

The build folder is named by what the binary depends on (the source, the flags, torch, Python,
the CPU), not by where the checkout lives: torch's own JIT rebuilds whenever the source's or
torch's path changes, which made every fresh clone or venv pay a ~20 s compile.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

from kernels.machine import cpu_signature

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_gemm.cpp"
_NAME = "tandem_int8_gemm"
_STALE_LOCK_S = 600  # a build takes ~1-2 min; an older lock is from a process that died
# -fopenmp: at::parallel_for is OpenMP in torch's CPU wheel (the pragma is inert without it);
# the extension then shares the libgomp.so.1 that torch has already loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_BUILT = "built"  # written after a finished build: a half-linked .so is never imported


@functools.cache
def load():
    """The compiled module (with `int8_gemm`), or None where it cannot be built."""
    if os.environ.get("TANDEM_INT8_KERNEL", "1") == "0":
        return None
    try:
        import torch  # noqa: F401 (the extension links against the loaded libtorch)
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        build_dir = Path(_get_build_directory(f"{_NAME}_{build_key()}", verbose=False))
        if (build_dir / _BUILT).is_file():
            return _import(build_dir / f"{_NAME}.so")
        _clear_stale_lock(build_dir)
        module = load_extension(_NAME, [str(_SOURCE)], extra_cflags=_FLAGS,
                                extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                                verbose=False)
        (build_dir / _BUILT).touch()
        return module
    except Exception as exc:  # no compiler, no ninja, no headers: the fallback still works
        log.warning("int8 CPU kernel unavailable (%s): int8 weights will be dequantized per "
                    "product, which is slower than fp32", str(exc).splitlines()[0][:200])
        return None


def build_key() -> str:
    """A digest of everything the compiled binary depends on, and of nothing path-like."""
    import torch

    h = hashlib.sha256(_SOURCE.read_bytes())
    for part in (*_FLAGS, torch.__version__, sys.version, cpu_signature()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _import(path: Path):
    if sys.modules.get(_NAME) is not None:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_NAME] = module
    return module


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
