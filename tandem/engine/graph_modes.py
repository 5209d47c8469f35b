"""The `--cuda-graphs` setting (torch-free, so configs can validate it): which decode steps
replay CUDA graphs (tandem/engine/cuda_graphs.py), and what `auto` reads: a `tandem gpu-check`
result (gpu-check.json) saying whether graphs gained on this GPU model."""
from __future__ import annotations

import json
from pathlib import Path

GRAPH_MODES = ("auto", "on", "off")


def check_mode(mode: str, device_type: str, measured_gain: bool | None = None) -> bool:
    """Whether decode steps use graphs. `auto`: on a GPU only when gpu-check measured a gain
    there (measured_gain True; none has been measured yet, docs/results/gpu.md); `on` off a
    GPU is an error."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "on" and device_type != "cuda":
        raise ValueError(f"--cuda-graphs on needs a CUDA device, not {device_type!r}")
    if mode == "auto":
        return device_type == "cuda" and measured_gain is True
    return mode == "on"


def measured_gain(path: str, device_name: str) -> bool | None:
    """From a gpu-check.json: True/False when it measured captured graphs on a GPU named
    `device_name`, else None (no file given, another GPU, or graphs not measured)."""
    if not path:
        return None
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the gpu-check result {path}: {exc}") from exc
    if summary.get("device_name") != device_name:
        return None
    return summary.get("recommendations", {}).get("cuda_graphs_auto_should_enable")
