"""LinearRouter's measured layouts, kept per machine (TANDEM_TUNE_CACHE).

Timing both layouts over every weight copy costs ~2.5 s per SmolLM2 load and ~5 s per Gemma 3
270M load (their vocab-wide heads dominate), paid again by every verifier, draft worker and
restart. The answer depends only on the shape, the dtype, the thread count, torch and the CPU,
so it is measured once and kept in one JSON file under the tandem cache. TANDEM_TUNE_CACHE=0
measures at every load, as before; any other value is the file to use.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from kernels.machine import cpu_signature
from tandem.models import cache_setting

ENV = "TANDEM_TUNE_CACHE"


class TuneCache:
    """`{key: {rows: use_mm}}` in a JSON file; unreadable or missing reads as empty."""

    def __init__(self, path: Path):
        self.path = path
        self._kept: dict | None = None  # the file as first read: once per load, not per shape

    @classmethod
    def default(cls) -> TuneCache | None:
        """The file TANDEM_TUNE_CACHE names, the tandem cache's without it, None for "0"."""
        path = cache_setting(ENV, "linear-tune.json")
        return None if path is None else cls(path)

    @staticmethod
    def key(weight: torch.Tensor, copies: int) -> str:
        # copies: timing runs over every copy to see the caches as a forward does
        return "|".join(map(str, (torch.__version__, torch.get_num_threads(), weight.dtype,
                                  tuple(weight.shape), copies, cpu_signature())))

    def get(self, key: str) -> dict[int, bool] | None:
        if self._kept is None:
            self._kept = self._read()
        hit = self._kept.get(key)
        return None if hit is None else {int(m): bool(v) for m, v in hit.items()}

    def put(self, entries: dict[str, dict[int, bool]]) -> None:
        """Merge and write atomically (other processes read and write it too); a cache that
        cannot be written is only a cache."""
        if not entries:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **entries}  # read again: other processes write it too
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".linear-tune-")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
            self._kept = merged
        except OSError:
            pass

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
