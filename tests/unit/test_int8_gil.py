"""The int8 kernel multiplies without holding the GIL: while one thread runs it, Python in
another thread keeps running (a colocated layer-skip draft worker; the verifier's event loop
and its gRPC streams during a forward). Held, every product stalled the whole process."""
import shutil
import threading
import time

import pytest
import torch

from kernels import int8_cpu
from tandem.engine.quant import Int8Weight

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(shutil.which("c++") is None,
                                 reason="no C++ compiler: int8 falls back to torch")]


def _spin(seconds: float) -> int:
    """Pure-Python loop iterations done in `seconds` of wall time."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def test_the_kernel_releases_the_gil():
    kernel = int8_cpu.load()
    assert kernel is not None
    torch.manual_seed(0)
    q = Int8Weight.quantize(torch.randn(8192, 2048))  # tens of ms per product on one core
    x = torch.randn(64, 2048)
    stop = threading.Event()

    def multiply():
        while not stop.is_set():
            kernel.int8_gemm(x, q.q, q.scale, q.zero, q.out_features)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the products on one core, the spinning thread on the other
    try:
        alone = _spin(0.4)
        worker = threading.Thread(target=multiply)
        worker.start()
        try:
            beside = _spin(0.4)
        finally:
            stop.set()
            worker.join()
    finally:
        torch.set_num_threads(threads)
    # Holding the GIL, the kernel would leave this thread a switch interval (5 ms) per
    # product: about a tenth of its loop.
    assert beside > 0.5 * alone, (beside, alone)


def test_the_build_is_found_again_from_another_checkout(tmp_path, monkeypatch):
    # The cache is keyed by what the binary depends on: a fresh clone (another path, the same
    # source) reuses this machine's build instead of compiling for ~20 s.
    assert int8_cpu.load() is not None
    key = int8_cpu.build_key()
    moved = tmp_path / "elsewhere" / "int8_gemm.cpp"
    moved.parent.mkdir()
    moved.write_bytes(int8_cpu._SOURCE.read_bytes())
    monkeypatch.setattr(int8_cpu, "_SOURCE", moved)
    assert int8_cpu.build_key() == key
    moved.write_bytes(moved.read_bytes() + b"\n// changed\n")
    assert int8_cpu.build_key() != key  # a changed kernel is rebuilt, never a stale one run
