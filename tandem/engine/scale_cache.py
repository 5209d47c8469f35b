"""The int8 group scales of each weight, kept per machine (TANDEM_SCALE_CACHE).

Finding a group's grid (tandem.engine.quant.group_scales: a sort of every group and four trial
steps) is ~85% of an int8 load: ~6 s of SmolLM2's 7 at one thread, paid by every verifier start
under `--dtype auto`. The scales are a pure function of the weight's bytes and of quant.py, so
each weight's are kept in a small file named by a digest of both; a later load reads them
(bit for bit what it would compute) and only rounds the codes. TANDEM_SCALE_CACHE=0 computes
them at every load; any other value is the folder to use.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.models import cache_setting

ENV = "TANDEM_SCALE_CACHE"
_QUANT_SOURCE = Path(__file__).resolve().parent / "quant.py"


class ScaleCache:
    def __init__(self, root: Path):
        self.root = root
        self._code = hashlib.sha1(_QUANT_SOURCE.read_bytes()).digest()

    @classmethod
    def default(cls) -> ScaleCache | None:
        """The folder TANDEM_SCALE_CACHE names, the tandem cache's without it, None for "0"."""
        path = cache_setting(ENV, "int8-scales")
        return None if path is None else cls(path)

    def scales(self, compute, w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
               ) -> torch.Tensor:  # [rows, groups] float32
        """compute(w, lo, hi) (group_scales), or what it returned for these bytes before.
        w: [rows, groups, group] float32 (contiguous); lo, hi: [rows, groups]."""
        path = self.root / f"{self._digest(w)}.safetensors"
        try:
            kept = load_file(path)["scale"]
            if kept.shape == lo.shape and kept.dtype == torch.float32:
                return kept
        except Exception:  # missing, torn or foreign: compute it again
            pass
        scale = compute(w, lo, hi)
        self._write(path, scale)
        return scale

    def _digest(self, w: torch.Tensor) -> str:
        h = hashlib.sha1(self._code)
        h.update(str(tuple(w.shape)).encode())
        h.update(memoryview(w.contiguous().numpy()).cast("B"))
        return h.hexdigest()

    def _write(self, path: Path, scale: torch.Tensor) -> None:
        """Atomically (other processes load the same model at once); a cache that cannot be
        written is only a cache."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".scale-", suffix=".tmp")
            os.close(fd)
            save_file({"scale": scale.contiguous()}, tmp)
            os.replace(tmp, path)
        except OSError:
            pass
