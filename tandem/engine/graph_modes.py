"""The `--cuda-graphs` setting (torch-free, so configs can validate it): which decode steps
replay CUDA graphs (tandem/engine/cuda_graphs.py)."""
from __future__ import annotations

GRAPH_MODES = ("auto", "on", "off")


def check_mode(mode: str, device_type: str) -> bool:
    """Whether decode steps use graphs. `auto` is off until gpu-check has measured a gain on
    a GPU (none has yet: docs/gpu.md); `on` off a GPU is an error."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "on" and device_type != "cuda":
        raise ValueError(f"--cuda-graphs on needs a CUDA device, not {device_type!r}")
    return mode == "on"
