"""`tandem gpu-check --device cpu --tiny`: the CPU dry run of the GPU window's one command.

It runs in a fresh interpreter in which the packages a stock PyTorch image lacks cannot be
imported (FastAPI, Redis, OpenTelemetry, Prometheus, grammar engines, flash-attn), so it also
shows that the command the device tool runs (docs/results/gpu.md) needs none of them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NOT_IN_THE_STOCK_IMAGE = ("fastapi", "starlette", "uvicorn", "redis", "llguidance", "xgrammar",
                          "opentelemetry", "prometheus_client", "flash_attn", "httpx")
PHASES = {"correctness", "attention", "cuda_graphs", "verify_cost", "decode", "colocate"}

RUN = r"""
import sys
BLOCKED = set(sys.argv[1].split(","))

class StockImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the stock PyTorch image")
        return None

sys.meta_path.insert(0, StockImage())
from tools.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_cpu_dry_run_passes_every_phase(tmp_path):
    out = tmp_path / "gpu-check"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", RUN, ",".join(NOT_IN_THE_STOCK_IMAGE), "gpu-check",
         "--device", "cpu", "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    seconds = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "gpu-check.json").read_text())
    assert set(summary["phases"]) == PHASES
    bad = {n: p.get("error") for n, p in summary["phases"].items() if p["status"] != "ok"}
    assert not bad and summary["all_ok"]
    checks = summary["phases"]["correctness"]["results"]["checks"]
    assert len(checks) >= 30 and all(c["ok"] for c in checks.values())
    assert "## correctness" in (out / "gpu-check.md").read_text()
    assert len(list(out.glob("*.png"))) <= 3
    assert seconds < 60, f"the dry run took {seconds:.1f} s"
    assert "gpu-check: [6/6] colocate: ok" in done.stderr  # progress on stderr


def test_bad_arguments_are_clear_errors(tmp_path):
    from tools.cli import main

    assert main(["gpu-check", "--out", str(tmp_path), "--phases", "nope"]) == 2
    assert main(["gpu-check", "--out", str(tmp_path), "--device", "cpu"]) == 2  # no --tiny
