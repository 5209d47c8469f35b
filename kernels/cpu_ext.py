"""Our C++ CPU kernels (kernels/csrc/*.cpp), each compiled once per machine.

A small torch extension compiled on first use with -march=native (the machine that serves is
the one that compiles) into torch's extension cache (TORCH_EXTENSIONS_DIR). Needs a C++
compiler and ninja; without them `build()` returns None and callers fall back to their torch
reference (correct, slower).

The build folder is named by what the binary depends on (the source, the flags, torch, Python,
the CPU), not by where the checkout lives: torch's own JIT rebuilds whenever the source's or
torch's path changes, which made every fresh clone or venv pay a ~20 s compile.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
import time
from pathlib import Path

from kernels.machine import cpu_signature

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
_STALE_LOCK_S = 600  # a build takes ~1-2 min; an older lock is from a process that died
# -fopenmp: at::parallel_for is OpenMP in torch's CPU wheel (the pragma is inert without it);
# the extension then shares the libgomp.so.1 that torch has already loaded.
FLAGS = ("-O3", "-march=native", "-fopenmp")
_BUILT = "built"  # written after a finished build: a half-linked .so is never imported


def build(name: str, source: Path, what: str):
    """The compiled module `name` of `source`, or None where it cannot be built (`what` names
    the fallback in the warning)."""
    try:
        import torch  # noqa: F401 (the extension links against the loaded libtorch)
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        build_dir = Path(_get_build_directory(f"{name}_{build_key(source)}", verbose=False))
        if (build_dir / _BUILT).is_file():
            return _import(name, build_dir / f"{name}.so")
        _clear_stale_lock(build_dir)
        module = load_extension(name, [str(source)], extra_cflags=list(FLAGS),
                                extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                                verbose=False)
        (build_dir / _BUILT).touch()
        return module
    except Exception as exc:  # no compiler, no ninja, no headers: the fallback still works
        log.warning("%s CPU kernel unavailable (%s): %s", name, str(exc).splitlines()[0][:200],
                    what)
        return None


def build_key(source: Path) -> str:
    """A digest of everything the compiled binary depends on, and of nothing path-like."""
    import torch

    h = hashlib.sha256(source.read_bytes())
    for part in (*FLAGS, torch.__version__, sys.version, cpu_signature()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _import(name: str, path: Path):
    if sys.modules.get(name) is not None:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
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
